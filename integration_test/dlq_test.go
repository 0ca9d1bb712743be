package integration_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testhook"
)

type order struct {
	ID     string `json:"id"`
	Amount int64  `json:"amount"`
}

// orderHandler: amount < 0 is permanent, "flaky" always fails, "boom" always
// panics; the rest apply the effect.
func orderHandler(member string) consumer.Handler {
	return consumer.JSON(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message, o order) error {
		switch {
		case o.Amount < 0:
			return dlq.Permanent(errors.New("negative amount"))
		case o.ID == "flaky":
			return errors.New("downstream unavailable")
		case o.ID == "boom":
			panic("handler bug")
		}
		return recordEffect(member)(ctx, tx, msg)
	})
}

// rec builds a record with a message-id header. The records of a partition
// share one key, so that they keep their order in every consumer mode.
func (e *env) rec(partition int32, id, value string, extra ...kgo.RecordHeader) *kgo.Record {
	return &kgo.Record{Topic: e.topic, Partition: partition, Key: []byte("k-" + itoa(int(partition))), Value: []byte(value),
		Headers: append([]kgo.RecordHeader{{Key: "message-id", Value: []byte(id)}}, extra...)}
}

func (e *env) produceRecords(t *testing.T, recs ...*kgo.Record) {
	t.Helper()
	cl := e.kafka.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

// dlqEntries lists the env's dead-letter topic.
func (e *env) dlqEntries(t *testing.T) []dlq.Entry {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	entries, err := dlq.List(ctx, []kgo.Opt{kgo.SeedBrokers(e.kafka.Brokers...)}, dlq.DefaultTopic(e.topic), dlq.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	return entries
}

// createDLQTopic returns the id of the env's dead-letter topic, which
// newEnv created with the source topic.
func (e *env) createDLQTopic(t *testing.T) [16]byte {
	t.Helper()
	return e.dlqID
}

func valueOf(id string, amount int64) string {
	b, _ := json.Marshal(order{ID: id, Amount: amount})
	return string(b)
}

// Every class of poison ends in the dead-letter topic with its headers, and
// the partition moves on: the records after each poison are applied, in order.
func TestEachPoisonClassIsDeadLettered(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	e.createDLQTopic(t)
	secret := kgo.RecordHeader{Key: "Authorization", Value: []byte("Bearer s3cret")}
	custom := kgo.RecordHeader{Key: "tenant", Value: []byte("acme")}
	e.produceRecords(t,
		e.rec(0, "ok-0", valueOf("ok-0", 1)),
		e.rec(0, "undecodable", `{"id": "x", "amount": `, secret, custom),
		e.rec(0, "ok-1", valueOf("ok-1", 1)),
		e.rec(0, "permanent", valueOf("permanent", -5)),
		e.rec(0, "ok-2", valueOf("ok-2", 1)),
		e.rec(0, "transient", valueOf("flaky", 1)),
		e.rec(0, "ok-3", valueOf("ok-3", 1)),
		e.rec(0, "panic", valueOf("boom", 1)),
		e.rec(0, "ok-4", valueOf("ok-4", 1)),
		e.rec(0, "oversized", valueOf("big", 1)+strings.Repeat(" ", 4096)),
		e.rec(0, "ok-5", valueOf("ok-5", 1)),
	)
	cfg := e.config("a", orderHandler("a"))
	cfg.MaxAttempts = 3
	cfg.MaxRecordBytes = 1024
	m := e.start(context.Background(), cfg)
	eventually(t, time.Minute, "every record handled and committed", func() bool {
		return m.c.Stats().DeadLettered == 5 && m.c.Stats().Processed == 6 && e.committedLag(t) == 0
	})
	if err := m.stop(t); err != nil {
		t.Fatal(err)
	}

	// The good records were applied in offset order.
	var ids []string
	rows, _ := e.db.Pool.Query(context.Background(), `SELECT message_id FROM effects ORDER BY seq`)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(ids, ","); got != "ok-0,ok-1,ok-2,ok-3,ok-4,ok-5" {
		t.Errorf("effects in order %s", got)
	}

	entries := e.dlqEntries(t)
	want := []struct {
		id       string
		offset   int64
		class    dlq.Class
		attempts int
	}{
		{"undecodable", 1, dlq.ClassUndecodable, 1},
		{"permanent", 3, dlq.ClassPermanent, 1},
		{"transient", 5, dlq.ClassMaxAttempts, 3},
		{"panic", 7, dlq.ClassPanic, 3},
		{"oversized", 9, dlq.ClassOversized, 0},
	}
	if len(entries) != len(want) {
		t.Fatalf("dead-letter topic holds %d records, want %d", len(entries), len(want))
	}
	for i, w := range want {
		en := entries[i]
		if en.Err != nil {
			t.Fatalf("entry %d: %v", i, en.Err)
		}
		info := en.Info
		if info.MessageID != w.id || info.Offset != w.offset || info.Class != w.class || info.Attempts != w.attempts {
			t.Errorf("entry %d = %s@%d class %s attempts %d; want %s@%d class %s attempts %d",
				i, info.MessageID, info.Offset, info.Class, info.Attempts, w.id, w.offset, w.class, w.attempts)
		}
		if info.Topic != e.topic || info.Partition != 0 || info.Group != e.group || info.Error == "" ||
			info.Timestamp.IsZero() || info.FirstFailure.After(info.LastFailure) || info.LastFailure.IsZero() {
			t.Errorf("entry %d: incomplete info %+v", i, info)
		}
		if string(en.Record.Key) != "k-0" {
			t.Errorf("entry %d: key %q not copied", i, en.Record.Key)
		}
		if o, err := dedup.MustNew(e.db.Schema).Lookup(context.Background(), e.db.Pool, e.group, w.id); err != nil || o != dedup.DeadLettered {
			t.Errorf("inbox outcome of %s = %q, %v; want dead_lettered", w.id, o, err)
		}
	}
	und := entries[0].Record
	if string(und.Value) != `{"id": "x", "amount": ` {
		t.Errorf("value bytes changed: %q", und.Value)
	}
	hdr := map[string]string{}
	for _, h := range und.Headers {
		hdr[h.Key] = string(h.Value)
	}
	if _, leaked := hdr["Authorization"]; leaked {
		t.Error("the Authorization header was copied to the dead-letter record")
	}
	if hdr["tenant"] != "acme" || hdr["message-id"] != "undecodable" {
		t.Errorf("headers not kept: %v", hdr)
	}
	if first, last := entries[2].Info.FirstFailure, entries[2].Info.LastFailure; !last.After(first) {
		t.Errorf("transient: first failure %v not before last %v over 3 attempts", first, last)
	}
}

// The dead-letter topic refuses writes: the poisoned partition holds at the
// poison (no loss, no commit past it) while the other partition flows; when
// the fault clears the record reaches the dead-letter topic once.
func TestDeadLetterOutageHoldsOnlyItsPartition(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	if e.kafka.Cluster == nil {
		t.Skip("refusing dead-letter produces needs the in-process kfake broker (KAFKA_BROKERS is set)")
	}
	dlqID := e.createDLQTopic(t)
	dlqTopic := dlq.DefaultTopic(e.topic)
	var refuse atomic.Bool
	refuse.Store(true)
	var refused atomic.Int64
	e.kafka.Cluster.ControlKey(kmsg.Produce.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		e.kafka.Cluster.KeepControl()
		pr := req.(*kmsg.ProduceRequest)
		if !refuse.Load() || len(pr.Topics) == 0 || (pr.Topics[0].Topic != dlqTopic && pr.Topics[0].TopicID != dlqID) {
			return nil, nil, false
		}
		refused.Add(1)
		return produceFailed(pr, func(kmsg.ProduceRequestTopic) int16 { return kerr.NotEnoughReplicas.Code }), nil, true
	})

	e.produceRecords(t, e.rec(0, "p0-ok", valueOf("p0-ok", 1)), e.rec(0, "poison", valueOf("poison", -1)))
	var p0After, p1 []*kgo.Record
	for i := range 20 {
		p0After = append(p0After, e.rec(0, "p0-after-"+itoa(i), valueOf("a", 1)))
		p1 = append(p1, e.rec(1, "p1-"+itoa(i), valueOf("b", 1)))
	}
	e.produceRecords(t, append(p0After, p1...)...)

	cfg := e.config("a", orderHandler("a"))
	cfg.DeadLetterTimeout = time.Second
	m := e.start(context.Background(), cfg)
	eventually(t, time.Minute, "partition 1 done while the dead-letter topic refuses writes", func() bool {
		return e.count(t, `SELECT count(*) FROM effects WHERE partition = 1`) == 20 && m.c.Stats().DeadLetterErrs >= 2
	})
	if n := e.count(t, `SELECT count(*) FROM effects WHERE partition = 0`); n != 1 {
		t.Fatalf("partition 0 applied %d records; it must hold at the poison (offset 1)", n)
	}
	eventually(t, 10*time.Second, "partition 0's offset committed up to the poison", func() bool {
		return e.committedOffset(t, 0) == 1
	})
	if off := e.committedOffset(t, 0); off != 1 {
		t.Fatalf("partition 0 committed offset %d, want 1 (never past the poison)", off)
	}
	// Not ready while the dead letter cannot be written, naming why.
	eventually(t, 10*time.Second, "not ready, naming the dead-letter topic", func() bool {
		why := m.c.NotReady()
		return strings.Contains(why, e.topic+"/0 waits for its dead-letter topic") && strings.Contains(why, dlqTopic)
	})
	refuse.Store(false)
	eventually(t, time.Minute, "partition 0 resumes after the fault", func() bool {
		return e.count(t, `SELECT count(*) FROM effects WHERE partition = 0`) == 21 && e.committedLag(t) == 0
	})
	eventually(t, 10*time.Second, "ready again", m.c.Ready)
	entries := e.dlqEntries(t)
	if len(entries) != 1 || entries[0].Copies != 1 || entries[0].Info.MessageID != "poison" {
		t.Fatalf("dead-letter entries = %+v, want the poison once", entries)
	}
	t.Logf("dead-letter produces refused: %d, retried by the consumer: %d", refused.Load(), m.c.Stats().DeadLetterErrs)
}

// A crash after the dead-letter produce and the inbox record, before the
// offset commit: the redelivered poison is skipped, not dead-lettered again.
func TestCrashAfterDeadLetterBeforeOffsetCommit(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	e.createDLQTopic(t)
	e.produceRecords(t, e.rec(0, "ok-0", valueOf("ok-0", 1)), e.rec(0, "poison", valueOf("poison", -1)), e.rec(0, "ok-1", valueOf("ok-1", 1)))
	cfg := e.config("a", orderHandler("a"))
	cfg.CommitInterval = time.Hour
	hooks := &testhook.Consumer{AfterDeadLetter: func(*kgo.Record) error { return testhook.ErrCrash }}
	first := e.start(testhook.WithConsumer(context.Background(), hooks), cfg)
	if err := first.wait(t, time.Minute); !errors.Is(err, testhook.ErrCrash) {
		t.Fatalf("Run = %v, want the simulated crash", err)
	}
	if lag := e.committedLag(t); lag != 3 {
		t.Fatalf("lag after crash = %d, want 3 (nothing committed)", lag)
	}
	second := e.start(context.Background(), e.config("b", orderHandler("b")))
	eventually(t, time.Minute, "second member done", func() bool { return e.committedLag(t) == 0 })
	s := second.c.Stats()
	if s.DeadLettered != 0 || s.Duplicates != 2 || s.Processed != 1 {
		t.Errorf("second member %+v: want the poison and ok-0 skipped as duplicates, ok-1 processed, nothing dead-lettered", s)
	}
	if entries := e.dlqEntries(t); len(entries) != 1 || entries[0].Copies != 1 {
		t.Errorf("dead-letter topic: entries %+v, want the poison once", entries)
	}
	e.assertExactlyOnce(t, 2)
}

// Redrive: a record rejected by one handler version is redriven after the
// fix and processed once; redriving it again changes nothing.
func TestRedriveProcessesOnceMore(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	e.produceRecords(t, e.rec(0, "order-7", valueOf("order-7", -3), kgo.RecordHeader{Key: "traceparent", Value: []byte("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")}))
	v1 := e.start(context.Background(), e.config("v1", orderHandler("v1")))
	eventually(t, time.Minute, "v1 dead-letters the order", func() bool { return v1.c.Stats().DeadLettered == 1 && e.committedLag(t) == 0 })
	if err := v1.stop(t); err != nil {
		t.Fatal(err)
	}

	// v2 accepts negative amounts (refunds).
	v2 := e.start(context.Background(), e.config("v2", consumer.JSON(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message, _ order) error {
		return recordEffect("v2")(ctx, tx, msg)
	})))
	entries := e.dlqEntries(t)
	if len(entries) != 1 {
		t.Fatalf("%d dead-letter entries, want 1", len(entries))
	}
	producer := e.kafka.Client(t)
	ctx := context.Background()
	dry, err := dlq.Redrive(ctx, producer, entries, dlq.RedriveOptions{DryRun: true})
	if err != nil || len(dry) != 1 || dry[0].Action != dlq.WouldRedrive || dry[0].Topic != e.topic {
		t.Fatalf("dry run = %+v, %v", dry, err)
	}
	if e.committedLag(t) != 0 {
		t.Fatal("the dry run produced a record")
	}
	if _, err := dlq.Redrive(ctx, producer, entries, dlq.RedriveOptions{}); !errors.Is(err, dlq.ErrNoInbox) {
		t.Fatalf("redrive without the inbox = %v, want ErrNoInbox", err)
	}
	inbox := dedup.MustNew(e.db.Schema)
	// A dry run with the inbox reads the outcomes in one query: the id is
	// dead-lettered, so it would be redriven.
	if dry, err = dlq.Redrive(ctx, nil, entries, dlq.RedriveOptions{DryRun: true, Inbox: inbox, DB: e.db.Pool}); err != nil || dry[0].Action != dlq.WouldRedrive {
		t.Fatalf("dry run with the inbox before the redrive = %+v, %v", dry, err)
	}
	opts := dlq.RedriveOptions{Inbox: inbox, DB: e.db.Pool}
	res, err := dlq.Redrive(ctx, producer, entries, opts)
	if err != nil || res[0].Action != dlq.Redriven {
		t.Fatalf("redrive = %+v, %v", res, err)
	}
	eventually(t, time.Minute, "v2 processes the redriven order", func() bool { return v2.c.Stats().Processed == 1 })
	e.assertExactlyOnce(t, 1)
	if dry, err = dlq.Redrive(ctx, nil, entries, dlq.RedriveOptions{DryRun: true, Inbox: inbox, DB: e.db.Pool}); err != nil || dry[0].Action != dlq.SkipProcessed {
		t.Fatalf("dry run with the inbox after the redriven record ran = %+v, %v, want %s", dry, err, dlq.SkipProcessed)
	}
	if n := e.count(t, `SELECT count(*) FROM `+e.db.Schema+`.redrive_grants`); n != 0 {
		t.Errorf("%d redrive grants left after the redriven record ran, want 0", n)
	}

	// The same redriven record again (the CLI run twice without its
	// check, or a copy of the record): the consumer's inbox makes it a no-op.
	e.produceRecords(t, dlq.RedriveRecord(&entries[0], e.topic, "message-id"))
	eventually(t, time.Minute, "v2 skips the second redrive", func() bool { return v2.c.Stats().Duplicates == 1 })
	e.assertExactlyOnce(t, 1)
	// With the inbox at hand, Redrive does not even produce it.
	res, err = dlq.Redrive(ctx, producer, entries, opts)
	if err != nil || res[0].Action != dlq.SkipProcessed {
		t.Fatalf("redrive with inbox = %+v, %v; want skipped as processed", res, err)
	}
	// The redriven record kept the trace context.
	var hasTrace bool
	for _, h := range dlq.RedriveRecord(&entries[0], e.topic, "message-id").Headers {
		hasTrace = hasTrace || h.Key == "traceparent"
	}
	if !hasTrace {
		t.Error("redriven record lost its traceparent")
	}
}

// TestForgedRedriveHeaderChangesNothing: a record that carries the
// oncely-redrive header without an operator's redrive (any producer can
// write the header) is a duplicate of its dead-lettered id, in every mode;
// a real redrive after it still runs the message once more, and only once.
// An oversized record's forged redrive is not dead-lettered again.
func TestForgedRedriveHeaderChangesNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	forged := kgo.RecordHeader{Key: dlq.HeaderRedrive, Value: []byte("anything/0/0")}
	big := valueOf("big", 1) + strings.Repeat(" ", 4096)
	e.produceRecords(t, e.rec(0, "order-9", valueOf("order-9", -3)), e.rec(0, "big", big))
	// Accepts negative amounts only after the redrive: the dead-lettered
	// id would run (and apply) again if a forged header were trusted.
	var accept atomic.Bool
	h := consumer.JSON(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message, o order) error {
		if o.Amount < 0 && !accept.Load() {
			return dlq.Permanent(errors.New("negative amount"))
		}
		return recordEffect("a")(ctx, tx, msg)
	})
	cfg := e.config("a", h)
	cfg.MaxRecordBytes = 1024
	m := e.start(context.Background(), cfg)
	eventually(t, time.Minute, "both dead-lettered", func() bool { return m.c.Stats().DeadLettered == 2 })
	accept.Store(true)

	// Forged copies, one with the plain header, one like a redrive record.
	e.produceRecords(t, e.rec(0, "order-9", valueOf("order-9", -3), forged), e.rec(0, "big", big, forged))
	entries := e.dlqEntries(t)
	var order9 *dlq.Entry
	for i := range entries {
		if entries[i].Info != nil && entries[i].Info.MessageID == "order-9" {
			order9 = &entries[i]
		}
	}
	if order9 == nil {
		t.Fatalf("no dead letter of order-9 among %d entries", len(entries))
	}
	e.produceRecords(t, dlq.RedriveRecord(order9, e.topic, "message-id"))
	eventually(t, time.Minute, "the forged records skipped and committed", func() bool {
		return m.c.Stats().Duplicates == 3 && e.committedLag(t) == 0
	})
	if n := e.count(t, `SELECT count(*) FROM effects`); n != 0 {
		t.Fatalf("%d effects: a forged redrive header ran a dead-lettered message", n)
	}
	if s := m.c.Stats(); s.DeadLettered != 2 {
		t.Errorf("dead-lettered %d, want 2: a forged redrive of the oversized record was dead-lettered again", s.DeadLettered)
	}

	// An operator's redrive runs it once more.
	res, err := dlq.Redrive(context.Background(), e.kafka.Client(t), []dlq.Entry{*order9},
		dlq.RedriveOptions{Inbox: dedup.MustNew(e.db.Schema), DB: e.db.Pool})
	if err != nil || res[0].Action != dlq.Redriven {
		t.Fatalf("redrive = %+v, %v", res, err)
	}
	eventually(t, time.Minute, "the redriven order applied", func() bool { return m.c.Stats().Processed == 1 })
	e.produceRecords(t, dlq.RedriveRecord(order9, e.topic, "message-id"))
	eventually(t, time.Minute, "a copy of the redriven record skipped", func() bool {
		return m.c.Stats().Duplicates == 4 && e.committedLag(t) == 0
	})
	e.assertExactlyOnce(t, 1)
}

// Copies of one dead-lettering (a crash between the dead-letter produce and
// the inbox record writes a second) are listed once with their count, also
// when a filter leaves that entry out.
func TestListCollapsesCopies(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	e.createDLQTopic(t)
	topic := dlq.DefaultTopic(e.topic)
	info := func(id string, off int64) *dlq.Info {
		now := time.Now()
		return &dlq.Info{Topic: e.topic, Offset: off, Timestamp: now, Group: e.group, MessageID: id, Attempts: 1,
			FirstFailure: now, LastFailure: now, Class: dlq.ClassPermanent, Error: "bad"}
	}
	a, b := e.rec(0, "a", "x"), e.rec(0, "b", "y")
	e.produceRecords(t,
		dlq.NewRecord(topic, a, info("a", 0), dlq.HeaderPolicy{}),
		dlq.NewRecord(topic, a, info("a", 0), dlq.HeaderPolicy{}), // the copy
		dlq.NewRecord(topic, b, info("b", 1), dlq.HeaderPolicy{}))

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	opts := []kgo.Opt{kgo.SeedBrokers(e.kafka.Brokers...)}
	all, err := dlq.List(ctx, opts, topic, dlq.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 2 || all[0].Info.MessageID != "a" || all[0].Copies != 2 || all[1].Info.MessageID != "b" || all[1].Copies != 1 {
		t.Fatalf("List = %+v, want a (2 copies) then b (1)", all)
	}
	onlyB, err := dlq.List(ctx, opts, topic, dlq.Filter{MessageID: "b"})
	if err != nil {
		t.Fatal(err)
	}
	if len(onlyB) != 1 || onlyB[0].Info.MessageID != "b" || onlyB[0].Copies != 1 {
		t.Fatalf("List(message id b) = %+v, want b alone", onlyB)
	}
}
