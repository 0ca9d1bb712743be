package integration_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/internal/topicread"
)

// TestTopicReadEndsAtATransactionMarker: a partition whose last entry is a
// transaction marker (no record follows a committed or aborted Kafka
// transaction) is read to its end, read committed or not: the marker counts
// as read and is not returned; read committed leaves the aborted records out.
// The history check reads the orders topic both ways to find aborted records.
func TestTopicReadEndsAtATransactionMarker(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	e.produceRecords(t, e.rec(0, "plain", "v"))
	cl := e.kafka.Client(t, kgo.TransactionalID(testenv.UniqueName("tx")), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	for _, commit := range []bool{false, true} {
		if err := cl.BeginTransaction(); err != nil {
			t.Fatal(err)
		}
		for i := range 2 {
			if err := cl.ProduceSync(ctx, e.rec(0, fmt.Sprintf("%v%d", commit, i), "v")).FirstErr(); err != nil {
				t.Fatal(err)
			}
		}
		if err := cl.EndTransaction(ctx, kgo.TransactionEndTry(commit)); err != nil {
			t.Fatal(err)
		}
	}
	opts := []kgo.Opt{kgo.SeedBrokers(e.kafka.Brokers...)}
	ids := func(recs []*kgo.Record) string {
		var s []string
		for _, r := range recs {
			s = append(s, header(r, "message-id"))
		}
		return fmt.Sprint(s)
	}
	all, err := topicread.All(ctx, opts, e.topic)
	if err != nil {
		t.Fatalf("read uncommitted: %v", err)
	}
	if got, want := ids(all), "[plain false0 false1 true0 true1]"; got != want {
		t.Errorf("read uncommitted: %s, want %s", got, want)
	}
	committed, err := topicread.All(ctx, append(opts, kgo.FetchIsolationLevel(kgo.ReadCommitted())), e.topic)
	if err != nil {
		t.Fatalf("read committed: %v", err)
	}
	if got, want := ids(committed), "[plain true0 true1]"; got != want {
		t.Errorf("read committed: %s, want %s", got, want)
	}
}
