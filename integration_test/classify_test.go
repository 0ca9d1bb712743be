package integration_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testenv"
)

// causeHandler fails the record named by its message id as a careless
// handler would, and applies the effect of every other record:
//   - "slow": a statement cancelled by the handler's own deadline (pgx closes
//     the connection over it);
//   - "sloppy": a statement that fails, whose error the handler ignores
//     before returning nil (COMMIT then rolls back).
func causeHandler(member string) consumer.Handler {
	effect := recordEffect(member)
	return func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		switch msg.ID {
		case "slow":
			sctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
			defer cancel()
			_, err := tx.Exec(sctx, `SELECT pg_sleep(5)`)
			return err
		case "sloppy":
			_, _ = tx.Exec(ctx, `SELECT 1/0`) // error ignored: the transaction is aborted
			return nil
		}
		return effect(ctx, tx, msg)
	}
}

// TestHandlerCausedFailuresAreDeadLettered: failures the handler caused are
// the record's, whatever they do to the connection or the transaction: they
// spend attempts and end in the dead-letter topic, and the records around
// them are applied. They used to read as a database outage and be retried
// forever, holding the partition. In every consumer mode.
func TestHandlerCausedFailuresAreDeadLettered(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	e.createDLQTopic(t)
	e.produceRecords(t,
		e.rec(0, "ok-0", "v"),
		e.rec(0, "slow", "v"),
		e.rec(0, "ok-1", "v"),
		e.rec(0, "sloppy", "v"),
		e.rec(0, "ok-2", "v"),
	)
	cfg := e.config("a", causeHandler("a"))
	cfg.MaxAttempts = 2
	m := e.start(context.Background(), cfg)
	eventually(t, time.Minute, "every record handled and committed", func() bool {
		s := m.c.Stats()
		return s.DeadLettered == 2 && s.Processed == 3 && e.committedLag(t) == 0
	})
	if !m.c.Ready() {
		t.Error("Ready() is false after handler-caused failures: they were taken for a database outage")
	}
	if err := m.stop(t); err != nil {
		t.Fatal(err)
	}
	e.assertExactlyOnce(t, 3)
	entries := e.dlqEntries(t)
	if len(entries) != 2 {
		t.Fatalf("dead-letter topic holds %d records, want 2", len(entries))
	}
	for i, id := range []string{"slow", "sloppy"} {
		info := entries[i].Info
		if info.MessageID != id || info.Class != dlq.ClassMaxAttempts || info.Attempts != 2 {
			t.Errorf("entry %d = %s class %s attempts %d (%s); want %s class %s attempts 2",
				i, info.MessageID, info.Class, info.Attempts, info.Error, id, dlq.ClassMaxAttempts)
		}
	}
	t.Logf("mode %s: %+v", consumerMode.name, m.c.Stats())
}

// TestUnstorableIDsAreUndecodable: a message-id header that Postgres text
// cannot hold (bytes that are not UTF-8, a NUL byte: a raw 16-byte UUID put
// there by a producer does this) makes the record undecodable, dead-lettered
// at once with the id escaped in the error, instead of failing its claim on
// every attempt.
func TestUnstorableIDsAreUndecodable(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	e.createDLQTopic(t)
	rawUUID := string([]byte{0x01, 0x8f, 0xa2, 0x00, 0xff, 0x7e, 0x70, 0x00, 0x80, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77})
	e.produceRecords(t,
		e.rec(0, "ok-0", "v"),
		e.rec(0, rawUUID, "v"),
		e.rec(0, "a\x00b", "v"),
		e.rec(0, "caf\xe9", "v"),
		e.rec(0, "ok-1", "v"),
	)
	cfg := e.config("a", recordEffect("a"))
	m := e.start(context.Background(), cfg)
	eventually(t, time.Minute, "every record handled and committed", func() bool {
		s := m.c.Stats()
		return s.DeadLettered == 3 && s.Processed == 2 && e.committedLag(t) == 0
	})
	if err := m.stop(t); err != nil {
		t.Fatal(err)
	}
	e.assertExactlyOnce(t, 2)
	entries := e.dlqEntries(t)
	if len(entries) != 3 {
		t.Fatalf("dead-letter topic holds %d records, want 3", len(entries))
	}
	for i, en := range entries {
		info := en.Info
		if info.Class != dlq.ClassUndecodable || info.Attempts != 1 || !strings.Contains(info.Error, `\x00`) && !strings.Contains(info.Error, `\xe9`) {
			t.Errorf("entry %d: class %s attempts %d error %q; want undecodable at once, the id escaped", i, info.Class, info.Attempts, info.Error)
		}
	}
}

// TestMissingInboxFailsAtStart: a consumer whose schema was never migrated
// (or set to another schema than the migrations') fails Run at once, naming
// the table, instead of retrying every claim as an outage.
func TestMissingInboxFailsAtStart(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	cfg := e.config("a", recordEffect("a"))
	cfg.Schema = testenv.UniqueName("unmigrated")
	assertNotMigrated(t, cfg, "inbox")
}

// TestAbortedTransactionsAreNotProcessed: records of a Kafka transaction
// that was aborted never reach the handler (the consumer reads committed).
func TestAbortedTransactionsAreNotProcessed(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cl := e.kafka.Client(t, kgo.TransactionalID(testenv.UniqueName("tx")), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	for _, commit := range []bool{false, true} {
		if err := cl.BeginTransaction(); err != nil {
			t.Fatal(err)
		}
		prefix := map[bool]string{false: "aborted", true: "committed"}[commit]
		for _, m := range uniqueMsgs(prefix, 5, 1) {
			rec := &kgo.Record{Topic: e.topic, Partition: 0, Key: []byte(m.key), Value: []byte(m.id),
				Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte(m.id)}}}
			if err := cl.ProduceSync(ctx, rec).FirstErr(); err != nil {
				t.Fatal(err)
			}
		}
		if err := cl.EndTransaction(ctx, kgo.TransactionEndTry(commit)); err != nil {
			t.Fatal(err)
		}
	}
	// One more record, produced last in the partition: once it is applied,
	// the consumer has read past every transactional record.
	e.produce(t, []msg{{id: "last", partition: 0, key: "k"}})
	m := e.start(context.Background(), e.config("a", recordEffect("a")))
	eventually(t, 30*time.Second, "the last record applied", func() bool {
		return e.count(t, `SELECT count(*) FROM effects WHERE message_id = 'last'`) == 1
	})
	if err := m.stop(t); err != nil {
		t.Fatal(err)
	}
	if n := e.count(t, `SELECT count(*) FROM effects WHERE message_id LIKE 'aborted-%'`); n != 0 {
		t.Errorf("%d records of the aborted transaction were processed", n)
	}
	e.assertExactlyOnce(t, 6)
}

// deadLetterBetweenOrders produces poison between two orders on partition
// 0, runs a consumer until the orders are applied, the poison dead-lettered
// and the offsets committed, and returns the dead-letter topic's entries.
func (e *env) deadLetterBetweenOrders(t *testing.T, poison *kgo.Record) []dlq.Entry {
	t.Helper()
	e.produceRecords(t, e.rec(0, "ok-0", valueOf("ok-0", 1)), poison, e.rec(0, "ok-1", valueOf("ok-1", 1)))
	m := e.start(context.Background(), e.config("a", orderHandler("a")))
	eventually(t, time.Minute, "every record handled and committed", func() bool {
		s := m.c.Stats()
		return s.DeadLettered == 1 && s.Processed == 2 && e.committedLag(t) == 0
	})
	if err := m.stop(t); err != nil {
		t.Fatal(err)
	}
	e.assertExactlyOnce(t, 2)
	return e.dlqEntries(t)
}

// TestDeadLetterTooLargeWritesAStub: a record whose dead-letter copy (its
// value plus oncely's headers) is over the dead-letter topic's size limit is
// dead-lettered as a stub, without its value, at once, instead of holding
// its partition forever on MESSAGE_TOO_LARGE; the records after it flow.
func TestDeadLetterTooLargeWritesAStub(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	limit := "4096"
	resp, err := kadm.NewClient(e.kafka.Client(t)).AlterTopicConfigs(ctx,
		[]kadm.AlterConfig{{Name: "max.message.bytes", Value: &limit}}, dlq.DefaultTopic(e.topic))
	if err == nil {
		err = errors.Join(resp[0].Err)
	}
	if err != nil {
		t.Fatal(err)
	}
	// Random bytes: not JSON (undecodable), and incompressible, so that
	// the copy with oncely's headers is over the limit however it is sent.
	raw := make([]byte, 4000)
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range raw {
		raw[i] = byte(rng.Uint32())
	}
	big := string(raw)
	entries := e.deadLetterBetweenOrders(t, e.rec(0, "big", big, kgo.RecordHeader{Key: "tenant", Value: []byte("acme")}))
	if len(entries) != 1 || entries[0].Info == nil {
		t.Fatalf("dead-letter topic holds %d records, want 1 decodable", len(entries))
	}
	en := entries[0]
	stub := ""
	for _, h := range en.Record.Headers {
		if h.Key == dlq.HeaderStub {
			stub = string(h.Value)
		}
	}
	if en.Info.MessageID != "big" || en.Info.Class != dlq.ClassUndecodable || len(en.Record.Value) != 0 || !strings.Contains(stub, "too large") {
		t.Errorf("dead letter %s class %s value %d bytes stub %q; want the stub of big, undecodable, no value", en.Info.MessageID, en.Info.Class, len(en.Record.Value), stub)
	}
	res, err := dlq.Redrive(ctx, e.kafka.Client(t), entries, dlq.RedriveOptions{Inbox: dedup.MustNew(e.db.Schema), DB: e.db.Pool})
	if err != nil || len(res) != 1 || res[0].Action != dlq.SkipStub {
		t.Errorf("redrive of a stub = %+v, %v; want it skipped", res, err)
	}
}

// TestDeadLetterInARefusedBatchIsNotAStub: the broker refuses a whole
// record batch as too large, so a dead letter that shared its batch with
// another partition's oversized copy is refused with MESSAGE_TOO_LARGE
// although it fits the topic. It is produced again, in full, not replaced by
// a stub that would lose its value. (Simulated: the first produce to the
// dead-letter topic is answered MESSAGE_TOO_LARGE; the chaos soak met the
// real case.)
func TestDeadLetterInARefusedBatchIsNotAStub(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	dlqTopic, dlqID := dlq.DefaultTopic(e.topic), e.createDLQTopic(t)
	var refused atomic.Int64
	e.kafka.Cluster.ControlKey(kmsg.Produce.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		e.kafka.Cluster.KeepControl()
		pr := req.(*kmsg.ProduceRequest)
		if len(pr.Topics) == 0 || (pr.Topics[0].Topic != dlqTopic && pr.Topics[0].TopicID != dlqID) || !refused.CompareAndSwap(0, 1) {
			return nil, nil, false
		}
		return produceFailed(pr, func(kmsg.ProduceRequestTopic) int16 { return kerr.MessageTooLarge.Code }), nil, true
	})
	entries := e.deadLetterBetweenOrders(t, e.rec(0, "bad", "not json"))
	if refused.Load() != 1 || len(entries) != 1 || entries[0].Info == nil {
		t.Fatalf("%d produces refused, %d dead letters; want 1 refused and 1 decodable dead letter", refused.Load(), len(entries))
	}
	en := entries[0]
	if header(en.Record, dlq.HeaderStub) != "" || string(en.Record.Value) != "not json" || en.Info.MessageID != "bad" {
		t.Errorf("dead letter of %s: value %q, stub %q; want the full copy", en.Info.MessageID, en.Record.Value, header(en.Record, dlq.HeaderStub))
	}
}

// TestRevokeCommitsPastAStuckWorker: when a revoked partition's in-flight
// record uses all of RevokeTimeout (and is abandoned), the records it
// finished before are still committed, so the partition's next owner does
// not receive them again. The commit on revoke used to run with the
// already expired RevokeTimeout deadline and fail.
func TestRevokeCommitsPastAStuckWorker(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	blocked := make(chan string, 2)
	effect := recordEffect("a")
	cfg := e.config("a", func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if strings.HasSuffix(msg.ID, "-stuck") {
			blocked <- msg.ID
			<-ctx.Done() // until abandoned
			return ctx.Err()
		}
		return effect(ctx, tx, msg)
	})
	cfg.RevokeTimeout, cfg.ShutdownTimeout, cfg.CommitInterval = time.Second, 2*time.Second, 10*time.Minute
	a := e.start(context.Background(), cfg)
	var first, stuck []msg
	for p := range int32(2) {
		key := "k-" + itoa(int(p))
		for i := range 5 {
			first = append(first, msg{id: "p" + itoa(int(p)) + "-" + itoa(i), partition: p, key: key})
		}
		stuck = append(stuck, msg{id: "p" + itoa(int(p)) + "-stuck", partition: p, key: key})
	}
	e.produce(t, first)
	eventually(t, 30*time.Second, "the first records applied", func() bool {
		return e.count(t, `SELECT count(*) FROM effects`) == int64(len(first))
	})
	e.produce(t, stuck)
	for range stuck {
		select {
		case <-blocked:
		case <-time.After(30 * time.Second):
			t.Fatal("the stuck records never reached the handler")
		}
	}
	// A second member: one partition is revoked from a, whose worker there
	// is stuck until RevokeTimeout abandons it.
	b := e.start(context.Background(), e.config("b", recordEffect("b")))
	eventually(t, time.Minute, "b applied the stuck record of the partition it took over", func() bool {
		return e.count(t, `SELECT count(*) FROM effects WHERE member = 'b'`) >= 1
	})
	if err := b.stop(t); err != nil {
		t.Fatal(err)
	}
	if d := b.c.Stats().Duplicates; d != 0 {
		t.Errorf("the new owner received %d records again that the revoked member had finished: the commit on revoke failed", d)
	}
	_ = a.stop(t)
}
