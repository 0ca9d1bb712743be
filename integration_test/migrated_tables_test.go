package integration_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
)

// A schema migrated before redrive_grants existed fails Run at start-up,
// naming the table: otherwise the first record carrying the redrive header
// (any producer may write one) would fail its claim on the missing table.
func TestMissingRedriveGrantsFailsAtStart(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	if _, err := e.db.Pool.Exec(context.Background(), `DROP TABLE redrive_grants`); err != nil {
		t.Fatal(err)
	}
	assertNotMigrated(t, e.config("a", recordEffect("a")), "redrive_grants")
}

// assertNotMigrated runs a consumer of cfg and expects Run to fail at
// start-up with ErrNotMigrated naming the table (or "table".column), and
// none of notNamed.
func assertNotMigrated(t *testing.T, cfg consumer.Config, table string, notNamed ...string) {
	t.Helper()
	c, err := consumer.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	want := cfg.Schema + `"."` + table
	if !strings.Contains(table, ".") {
		want += `"`
	}
	err = c.Run(ctx)
	if !errors.Is(err, consumer.ErrNotMigrated) || !strings.Contains(err.Error(), want) {
		t.Fatalf("Run = %v; want ErrNotMigrated naming %s.%s", err, cfg.Schema, table)
	}
	for _, s := range notNamed {
		if strings.Contains(err.Error(), s) {
			t.Fatalf("Run = %v; want %s not named", err, s)
		}
	}
}

// A table that goes missing while the consumer runs (dropped by hand, a
// down migration) fails statements with 42P01, which no waiting ends: the
// records whose dead-letter path needs redrive_grants are dead-lettered (or
// skipped as duplicates), the error is logged, and the partition goes on.
// Nothing waits for the database, which answers.
func TestRedriveGrantsDroppedWhileRunningDoNotStopThePartition(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	cfg := e.config("a", recordEffect("a"))
	cfg.MaxAttempts = 2
	cfg.MaxRecordBytes = 1024
	m := e.start(context.Background(), cfg)
	e.produceRecords(t, e.rec(0, "first", "first"))
	eventually(t, time.Minute, "the first record processed", func() bool {
		return e.count(t, `SELECT count(*) FROM effects`) == 1
	})
	if _, err := e.db.Pool.Exec(context.Background(), `DROP TABLE redrive_grants`); err != nil {
		t.Fatal(err)
	}
	forged := kgo.RecordHeader{Key: dlq.HeaderRedrive, Value: []byte("x/0/0")}
	e.produceRecords(t,
		// Its claim fails on the missing table until its attempts run
		// out; then its dead-letter inbox row cannot consume a grant.
		e.rec(0, "forged", "forged", forged),
		// Oversized, of an id now dead-lettered: its grant cannot be
		// looked up, so it has none.
		e.rec(0, "forged", strings.Repeat("x", 2048), forged),
		e.rec(0, "after", "after"))
	eventually(t, time.Minute, "the record after them processed and committed", func() bool {
		return e.count(t, `SELECT count(*) FROM effects WHERE message_id = 'after'`) == 1 && e.committedLag(t) == 0
	})
	if s := m.c.Stats(); s.DeadLettered != 1 || s.Duplicates != 1 {
		t.Errorf("dead-lettered %d, duplicates %d; want the forged record dead-lettered and its oversized copy skipped", s.DeadLettered, s.Duplicates)
	}
	if n := len(e.dlqEntries(t)); n != 1 {
		t.Errorf("%d dead-letter records, want 1", n)
	}
	if n := e.count(t, `SELECT count(*) FROM inbox WHERE message_id = 'forged' AND outcome = 'dead_lettered'`); n != 1 {
		t.Errorf("the forged record's inbox row: %d dead_lettered rows, want 1", n)
	}
	if why := m.c.NotReady(); why != "" {
		t.Errorf("NotReady = %q after the partition moved on", why)
	}
	if err := m.stop(t); err != nil {
		t.Fatal(err)
	}
}
