package dedup_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/internal/pgtest"
	"github.com/oncely/oncely/internal/sqlident"
)

// seed inserts n rows for group whose processed_at is age before database
// now (age 0: fresh). Ages are set with an UPDATE in database time.
func seed(t *testing.T, ctx context.Context, db *pgtest.DB, group, prefix string, n int, age string) {
	t.Helper()
	table := sqlident.Table(db.Schema, "inbox")
	_, err := db.Pool.Exec(ctx, `INSERT INTO `+table+` (consumer_group, message_id)
		SELECT $1, $2 || i FROM generate_series(1, $3::int) AS i`, group, prefix, n)
	if err != nil {
		t.Fatalf("seed %s/%s: %v", group, prefix, err)
	}
	_, err = db.Pool.Exec(ctx, `UPDATE `+table+` SET processed_at = now() - $3::interval
		WHERE consumer_group = $1 AND message_id LIKE $2 || '%'`, group, prefix, age)
	if err != nil {
		t.Fatalf("age %s/%s: %v", group, prefix, err)
	}
}

func newCleaner(t *testing.T, db *pgtest.DB, cfg dedup.CleanerConfig) *dedup.Cleaner {
	t.Helper()
	cfg.Schema = db.Schema
	c, err := dedup.NewCleaner(db.Pool, cfg)
	if err != nil {
		t.Fatalf("NewCleaner: %v", err)
	}
	return c
}

func TestNewCleanerValidates(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	for _, tc := range []struct {
		cfg   dedup.CleanerConfig
		field string
	}{
		{dedup.CleanerConfig{}, "CleanerConfig.Retention"},
		{dedup.CleanerConfig{Retention: dedup.MinRetention - time.Second}, "CleanerConfig.Retention"},
		{dedup.CleanerConfig{Retention: 5 * time.Minute}, "CleanerConfig.Retention"},
		{dedup.CleanerConfig{Retention: -24 * time.Hour}, "CleanerConfig.Retention"},
		{dedup.CleanerConfig{Retention: 24 * time.Hour, Schema: "Bad"}, "CleanerConfig.Schema"},
		{dedup.CleanerConfig{Retention: 24 * time.Hour, Schema: `x"; drop table y`}, "CleanerConfig.Schema"},
		{dedup.CleanerConfig{Retention: 24 * time.Hour, BatchSize: -1}, "CleanerConfig.BatchSize"},
		{dedup.CleanerConfig{Retention: 24 * time.Hour, Interval: -time.Second}, "CleanerConfig.Interval"},
	} {
		c, err := dedup.NewCleaner(db.Pool, tc.cfg)
		if err == nil {
			t.Errorf("NewCleaner(%+v) = %v, nil; want an error", tc.cfg, c)
			continue
		}
		if !strings.Contains(err.Error(), tc.field) {
			t.Errorf("NewCleaner(%+v) error %q does not name %s", tc.cfg, err, tc.field)
		}
	}
	if _, err := dedup.NewCleaner(db.Pool, dedup.CleanerConfig{Retention: dedup.MinRetention}); err != nil {
		t.Errorf("NewCleaner with Retention = MinRetention: %v", err)
	}
	if _, err := dedup.NewCleaner(nil, dedup.CleanerConfig{Retention: dedup.MinRetention}); err == nil {
		t.Error("NewCleaner(nil db) succeeded, want an error")
	}
}

func TestDeleteExpiredInBatches(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		expired, batch int
	}{
		{50, 7}, // the last batch is partial
		{49, 7}, // an exact multiple: the loop must not stop at a full batch
		{3, 0},  // default batch size
	} {
		t.Run(fmt.Sprintf("%d_rows_batch_%d", tc.expired, tc.batch), func(t *testing.T) {
			t.Parallel()
			db, _, ctx := setup(t)
			seed(t, ctx, db, "g", "old-", tc.expired, "3 hours")
			seed(t, ctx, db, "g", "edge-", 4, "59 minutes") // younger than the retention
			seed(t, ctx, db, "g", "fresh-", 6, "0")
			c := newCleaner(t, db, dedup.CleanerConfig{Retention: time.Hour, BatchSize: tc.batch})

			n, err := c.DeleteExpired(ctx)
			if err != nil {
				t.Fatalf("DeleteExpired: %v", err)
			}
			if n != int64(tc.expired) {
				t.Errorf("DeleteExpired = %d, want %d", n, tc.expired)
			}
			if left := inboxCount(t, ctx, db, "message_id LIKE 'old-%'"); left != 0 {
				t.Errorf("%d expired rows left", left)
			}
			if kept := inboxCount(t, ctx, db, "message_id NOT LIKE 'old-%'"); kept != 10 {
				t.Errorf("%d unexpired rows kept, want 10", kept)
			}
			if n, err := c.DeleteExpired(ctx); err != nil || n != 0 {
				t.Errorf("second DeleteExpired = %d, %v; want 0, nil", n, err)
			}
		})
	}
}

func TestDeleteExpiredGroupFilter(t *testing.T) {
	t.Parallel()
	db, _, ctx := setup(t)
	seed(t, ctx, db, "billing", "old-", 12, "2 days")
	seed(t, ctx, db, "shipping", "old-", 9, "2 days")
	seed(t, ctx, db, "billing", "fresh-", 2, "0")

	n, err := newCleaner(t, db, dedup.CleanerConfig{Retention: 24 * time.Hour, Group: "billing", BatchSize: 5}).DeleteExpired(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n != 12 {
		t.Errorf("DeleteExpired(billing) = %d, want 12", n)
	}
	if got := inboxCount(t, ctx, db, "consumer_group = 'billing'"); got != 2 {
		t.Errorf("billing has %d rows, want its 2 fresh ones", got)
	}
	if got := inboxCount(t, ctx, db, "consumer_group = 'shipping'"); got != 9 {
		t.Errorf("shipping has %d rows, want its 9 untouched", got)
	}

	// Without a group filter every group is cleaned.
	n, err = newCleaner(t, db, dedup.CleanerConfig{Retention: 24 * time.Hour}).DeleteExpired(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n != 9 {
		t.Errorf("DeleteExpired(all groups) = %d, want shipping's 9", n)
	}
	if got := inboxCount(t, ctx, db, ""); got != 2 {
		t.Errorf("%d rows left, want 2", got)
	}
}

// TestDeleteExpiredSkipsLockedRows checks that the cleaner does not wait for
// a row another transaction holds: it deletes the rest and leaves that one
// for a later pass.
func TestDeleteExpiredSkipsLockedRows(t *testing.T) {
	t.Parallel()
	db, _, ctx := setup(t)
	seed(t, ctx, db, "g", "old-", 5, "3 hours")
	table := sqlident.Table(db.Schema, "inbox")
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	if _, err := tx.Exec(ctx, `SELECT 1 FROM `+table+` WHERE message_id = 'old-1' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	c := newCleaner(t, db, dedup.CleanerConfig{Retention: time.Hour, BatchSize: 2})

	passCtx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	n, err := c.DeleteExpired(passCtx)
	if err != nil {
		t.Fatalf("DeleteExpired with a locked row: %v", err)
	}
	if n != 4 {
		t.Errorf("DeleteExpired = %d, want the 4 unlocked rows", n)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n, err := c.DeleteExpired(ctx); err != nil || n != 1 {
		t.Errorf("DeleteExpired after the lock ended = %d, %v; want 1", n, err)
	}
}

func TestCleanerRun(t *testing.T) {
	t.Parallel()
	db, in, ctx := setup(t)
	seed(t, ctx, db, "g", "old-", 8, "2 hours")
	seed(t, ctx, db, "g", "fresh-", 3, "0")
	// A short interval so that later passes happen within the test.
	c := newCleaner(t, db, dedup.CleanerConfig{Retention: time.Hour, BatchSize: 3, Interval: 10 * time.Millisecond})

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()

	expiredGone := func() bool { return inboxCount(t, ctx, db, "message_id LIKE 'old-%'") == 0 }
	pgtest.WaitFor(t, ctx, "the first pass to delete the expired rows", expiredGone)

	// Rows that expire while Run is running are deleted by a later pass.
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := in.Claim(ctx, tx, dedup.Entry{Group: "g", MessageID: "old-late"})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE `+sqlident.Table(db.Schema, "inbox")+
		` SET processed_at = now() - interval '90 minutes' WHERE message_id = 'old-late'`); err != nil {
		t.Fatal(err)
	}
	pgtest.WaitFor(t, ctx, "a later pass to delete a newly expired row", expiredGone)

	stop()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run returned %v after cancellation, want nil", err)
		}
	case <-ctx.Done():
		t.Fatal("Run did not return after its context was cancelled")
	}
	if got := inboxCount(t, ctx, db, ""); got != 3 {
		t.Errorf("%d rows left, want the 3 fresh ones", got)
	}
}

// TestCleanerRunStopsDuringInterval checks that cancellation ends Run while it
// waits for its next pass, without waiting out the interval.
func TestCleanerRunStopsDuringInterval(t *testing.T) {
	t.Parallel()
	db, _, ctx := setup(t)
	seed(t, ctx, db, "g", "old-", 2, "2 hours")
	c := newCleaner(t, db, dedup.CleanerConfig{Retention: time.Hour, Interval: time.Hour})

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	// The first pass runs at once, not after an interval.
	pgtest.WaitFor(t, ctx, "the first pass", func() bool { return inboxCount(t, ctx, db, "") == 0 })
	stop()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run = %v, want nil", err)
		}
	case <-ctx.Done():
		t.Fatal("Run did not return within the test's deadline after cancellation (it waited for the 1h interval?)")
	}

	// Already cancelled: returns nil at once.
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if err := c.Run(cancelled); err != nil {
		t.Errorf("Run on a cancelled context = %v, want nil", err)
	}
}
