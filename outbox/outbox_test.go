package outbox_test

import (
	"context"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/oncely/oncely/internal/pgtest"
	"github.com/oncely/oncely/outbox"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

func migrated(tb testing.TB) *pgtest.DB {
	tb.Helper()
	return pgtest.Migrate(tb, pgtest.Postgres(tb))
}

func TestConfigErrorsNameTheField(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		err   error
		field string
	}{
		{func() error { _, err := outbox.New(outbox.Config{Schema: `x"; drop table y`}); return err }(), "Config.Schema"},
		{func() error { _, err := outbox.New(outbox.Config{Shards: -1}); return err }(), "Config.Shards"},
		{func() error { _, err := outbox.NewRelay(outbox.RelayConfig{Brokers: []string{"b"}}); return err }(), "RelayConfig.Pool"},
		{func() error {
			_, err := outbox.NewRelay(outbox.RelayConfig{Pool: pgtest.Postgres(t).Pool, Brokers: []string{"b"}, ProduceTimeout: time.Millisecond})
			return err
		}(), "RelayConfig.ProduceTimeout"},
		{func() error {
			_, err := outbox.NewRelay(outbox.RelayConfig{Pool: pgtest.Postgres(t).Pool})
			return err
		}(), "RelayConfig.Brokers"},
		{func() error {
			_, err := outbox.NewRelay(outbox.RelayConfig{Pool: pgtest.Postgres(t).Pool, Brokers: []string{"b"}, CleanupBatch: -1})
			return err
		}(), "RelayConfig.CleanupBatch"},
	} {
		if tc.err == nil || !strings.Contains(tc.err.Error(), tc.field) {
			t.Errorf("error %v does not name %s", tc.err, tc.field)
		}
	}
}

func TestEnqueueRefusesBadMessages(t *testing.T) {
	t.Parallel()
	db := migrated(t)
	o, _ := outbox.New(outbox.Config{Schema: db.Schema})
	ctx := context.Background()
	for _, m := range []outbox.Message{
		{Value: []byte("no topic")},
		{Topic: "t", Headers: []outbox.Header{{Key: "message-id", Value: []byte("mine")}}},
	} {
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { _, err := o.Enqueue(ctx, tx, m); return err })
		if err == nil {
			t.Errorf("Enqueue(%+v) succeeded", m)
		}
	}
	if st, _ := o.Status(ctx, db.Pool); st.Pending != 0 {
		t.Errorf("%d rows stored from refused messages", st.Pending)
	}
}

// Two transactions enqueuing the same key serialize: the second waits until
// the first commits, so its row id (and publish order) comes after.
func TestSameKeyEnqueuersSerialize(t *testing.T) {
	t.Parallel()
	db := migrated(t)
	o, _ := outbox.New(outbox.Config{Schema: db.Schema})
	ctx := context.Background()
	tx1, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx1.Rollback(ctx)
	if _, err := o.Enqueue(ctx, tx1, outbox.Message{Topic: "t", Key: []byte("k"), Value: []byte("first")}); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		done <- pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			_, err := o.Enqueue(ctx, tx, outbox.Message{Topic: "t", Key: []byte("k"), Value: []byte("second")},
				outbox.Message{Topic: "t", Key: []byte("other"), Value: []byte("x")})
			return err
		})
	}()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var waiting int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND wait_event = 'advisory'`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting > 0 {
			break
		}
		select {
		case err := <-done:
			t.Fatalf("second enqueuer finished (%v) while the first held the key", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("second enqueuer never waited on the key lock")
		}
		time.Sleep(10 * time.Millisecond) // polling interval
	}
	if err := tx1.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	rows, _ := db.Pool.Query(ctx, `SELECT value FROM outbox WHERE key = 'k' ORDER BY id`)
	vals, err := pgx.CollectRows(rows, pgx.RowTo[[]byte])
	if err != nil || len(vals) != 2 || string(vals[0]) != "first" || string(vals[1]) != "second" {
		t.Fatalf("rows of key k in id order: %q, %v", vals, err)
	}
}

func TestDeleteSentKeepsPendingAndRecent(t *testing.T) {
	t.Parallel()
	db := migrated(t)
	o, _ := outbox.New(outbox.Config{Schema: db.Schema})
	ctx := context.Background()
	var msgs []outbox.Message
	for range 60 {
		msgs = append(msgs, outbox.Message{Topic: "t", Value: []byte("v")})
	}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { _, err := o.Enqueue(ctx, tx, msgs...); return err }); err != nil {
		t.Fatal(err)
	}
	// 45 sent two days ago, 5 sent just now, 10 pending.
	if _, err := db.Pool.Exec(ctx, `UPDATE outbox SET sent_at = now() - interval '2 days' WHERE id IN (SELECT id FROM outbox ORDER BY id LIMIT 45)`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE outbox SET sent_at = now() WHERE id IN (SELECT id FROM outbox WHERE sent_at IS NULL ORDER BY id LIMIT 5)`); err != nil {
		t.Fatal(err)
	}
	n, err := o.DeleteSent(ctx, db.Pool, 24*time.Hour, 7)
	if err != nil || n != 45 {
		t.Fatalf("DeleteSent = %d, %v; want 45 in batches of 7", n, err)
	}
	st, err := o.Status(ctx, db.Pool)
	if err != nil || st.Pending != 10 || st.Sent != 5 {
		t.Fatalf("status after retention %+v, %v; want 10 pending, 5 sent kept", st, err)
	}
	if _, err := o.DeleteSent(ctx, db.Pool, time.Hour, 0); err == nil {
		t.Error("batch 0 accepted")
	}
}

// A caller-supplied id (a webhook delivery id) is kept; enqueuing it again
// while the first is in the outbox is reported as a duplicate, also when two
// transactions race.
func TestCallerIDsDedup(t *testing.T) {
	t.Parallel()
	db := migrated(t)
	o, _ := outbox.New(outbox.Config{Schema: db.Schema})
	ctx := context.Background()
	enqueue := func(msgs ...outbox.Message) []outbox.Enqueued {
		var out []outbox.Enqueued
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			var err error
			out, err = o.Enqueue(ctx, tx, msgs...)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return out
	}
	first := enqueue(outbox.Message{ID: "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W", Topic: "t"}, outbox.Message{ID: "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W", Topic: "t"})
	if first[0].Duplicate || !first[1].Duplicate || first[0].MessageID != "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W" {
		t.Fatalf("first call: %+v", first)
	}
	var dups atomic.Int64
	var wg sync.WaitGroup
	for range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if enqueue(outbox.Message{ID: "evt_1", Topic: "t"}, outbox.Message{ID: "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W", Topic: "t"})[0].Duplicate {
				dups.Add(1)
			}
		}()
	}
	wg.Wait()
	if dups.Load() != 9 {
		t.Errorf("%d of 10 racing enqueues of evt_1 were duplicates, want 9", dups.Load())
	}
	if st, _ := o.Status(ctx, db.Pool); st.Pending != 2 {
		t.Errorf("pending = %d, want 2 distinct ids", st.Pending)
	}
}
