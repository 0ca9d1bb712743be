package consumer

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"
)

// testRun is a run of a consumer whose client never connects: enough for
// the bookkeeping of workers and readiness.
func testRun(t *testing.T) (*Consumer, *run) {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none") // connects lazily: never here
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	c, err := New(Config{Brokers: []string{"127.0.0.1:1"}, Topics: []string{"t"}, Group: "g", Pool: pool,
		Handler: func(context.Context, pgx.Tx, *Message) error { return nil }, StuckAfter: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers("127.0.0.1:1"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	r := &run{c: c, cl: cl, workCtx: context.Background(), workers: map[tp]*worker{}}
	c.live.Store(r)
	c.polling.Store(true)
	return c, r
}

func (r *run) testWorker(partition int32) *worker {
	w := r.newWorker(tp{"t", partition})
	r.workers[w.tp] = w
	return w
}

// A partition that waits for the database keeps its member unready only
// while the member owns it: once revoked (or lost), it counts no more,
// whatever its last attempt saw; the member's other partitions still count.
func TestRevokedPartitionLeavesReadiness(t *testing.T) {
	c, r := testRun(t)
	w0, w1 := r.testWorker(0), r.testWorker(1)
	if ok, why := readiness(c); !ok {
		t.Fatalf("NotReady = false, %q with two idle partitions", why)
	}
	w0.databaseDown(true)
	w1.databaseDown(true)
	if ok, why := readiness(c); ok || !strings.Contains(why, "t/0 waits for the database") || !strings.Contains(why, "t/1 waits for the database") {
		t.Fatalf("NotReady = %v, %q; want not ready naming t/0 and t/1", ok, why)
	}
	r.remove([]*worker{w0})
	w0.databaseDown(true) // a late attempt of the revoked worker changes nothing
	if ok, why := readiness(c); ok || strings.Contains(why, "t/0") || !strings.Contains(why, "t/1") {
		t.Fatalf("after revoking t/0: NotReady = %v, %q; want not ready for t/1 only", ok, why)
	}
	w1.databaseDown(false)
	if ok, why := readiness(c); !ok {
		t.Fatalf("NotReady = false, %q after t/0 was revoked and t/1's database answered", why)
	}
	// The partition assigned again gets a fresh worker, ready.
	r.testWorker(0)
	if ok, why := readiness(c); !ok {
		t.Fatalf("NotReady = false, %q with t/0 assigned again", why)
	}
}

// A partition on one record past StuckAfter makes its member unready,
// naming the offset; finishing the record clears it; an idle partition is
// never stuck.
func TestStuckPartitionReadiness(t *testing.T) {
	c, r := testRun(t)
	w := r.testWorker(0)
	w.push([]*kgo.Record{{Topic: "t", Partition: 0, Offset: 41}, {Topic: "t", Partition: 0, Offset: 42}})
	if _, ok := w.pop(); !ok {
		t.Fatal("no record buffered")
	}
	w.since = w.since.Add(-2 * time.Minute) // on offset 41 for two minutes
	if ok, why := readiness(c); ok || !strings.Contains(why, "t/0 stuck on offset 41") {
		t.Fatalf("NotReady = %v, %q; want stuck on offset 41", ok, why)
	}
	w.markDone(&kgo.Record{Offset: 41})
	if ok, why := readiness(c); !ok {
		t.Fatalf("NotReady = false, %q after offset 41 finished", why)
	}
	w.idle()
	if ok, why := readiness(c); !ok || !w.since.IsZero() {
		t.Fatalf("NotReady = false, %q while idle", why)
	}
}

// Many waiting partitions: the first few are named, the rest counted.
func TestReadinessNamesAFewPartitions(t *testing.T) {
	c, r := testRun(t)
	for p := range int32(8) {
		r.testWorker(p).databaseDown(true)
	}
	ok, why := readiness(c)
	if ok || strings.Count(why, "waits for the database") != maxReasons || !strings.HasSuffix(why, "and 3 more partitions") {
		t.Fatalf("NotReady = %v, %q; want %d partitions named and 3 counted", ok, why, maxReasons)
	}
}

// Not running: not ready, and said so.
func TestReadinessNotRunning(t *testing.T) {
	c, _ := testRun(t)
	c.polling.Store(false)
	if ok, why := readiness(c); ok || !strings.HasPrefix(why, "not consuming") {
		t.Fatalf("NotReady = %v, %q; want not consuming", ok, why)
	}
}

// readiness is Ready and NotReady at once.
func readiness(c *Consumer) (bool, string) {
	why := c.NotReady()
	return why == "", why
}
