package integration_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/dlq"
)

// While an operator's redrive grant is pending, a record that carries the
// dead-lettered id and a redrive header naming another dead-letter record
// (anybody can write both) is a duplicate and leaves the grant; the
// operator's redriven record then runs the message once.
func TestForgedRedriveDoesNotTakeAPendingGrant(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	e.produceRecords(t, e.rec(0, "order-7", valueOf("order-7", -3)))
	var accept atomic.Bool
	h := consumer.JSON(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message, o order) error {
		if o.Amount < 0 && !accept.Load() {
			return dlq.Permanent(errors.New("negative amount"))
		}
		return recordEffect("a")(ctx, tx, msg)
	})
	m := e.start(context.Background(), e.config("a", h))
	eventually(t, time.Minute, "order-7 dead-lettered", func() bool { return m.c.Stats().DeadLettered == 1 })
	accept.Store(true)
	entries := e.dlqEntries(t)
	if len(entries) != 1 || entries[0].Info == nil {
		t.Fatalf("%d dead-letter entries, want order-7's", len(entries))
	}
	order7 := &entries[0]

	// The grant as dlq.Redrive records it, before its record is produced.
	inbox := dedup.MustNew(e.db.Schema)
	if err := inbox.GrantRedrive(context.Background(), e.db.Pool, e.group, "order-7", order7.Ref()); err != nil {
		t.Fatal(err)
	}
	forged := e.rec(0, "order-7", valueOf("order-7", -3),
		kgo.RecordHeader{Key: dlq.HeaderRedrive, Value: []byte(order7.Info.Topic + "/0/999")})
	e.produceRecords(t, forged)
	eventually(t, time.Minute, "the forged redrive skipped and committed", func() bool {
		return m.c.Stats().Duplicates == 1 && e.committedLag(t) == 0
	})
	if n := e.count(t, `SELECT count(*) FROM effects`); n != 0 {
		t.Fatalf("%d effects: a forged redrive took the operator's grant", n)
	}
	if n := e.count(t, `SELECT count(*) FROM redrive_grants WHERE ref = $1`, order7.Ref()); n != 1 {
		t.Fatalf("%d grants for %s left after the forged record, want 1", n, order7.Ref())
	}

	e.produceRecords(t, dlq.RedriveRecord(order7, e.topic, "message-id"))
	eventually(t, time.Minute, "the operator's redriven record processed", func() bool {
		return m.c.Stats().Processed == 1 && e.committedLag(t) == 0
	})
	if n := e.count(t, `SELECT count(*) FROM redrive_grants`); n != 0 {
		t.Errorf("%d grants left after the redriven record ran, want 0", n)
	}
	if err := m.stop(t); err != nil {
		t.Fatal(err)
	}
	e.assertExactlyOnce(t, 1)
}
