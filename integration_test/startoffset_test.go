package integration_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/internal/testenv"
)

// Config.StartOffset: a new group with StartLatest skips the records
// produced before it got its partitions and processes those produced after;
// once it has committed offsets they win (records produced while it was
// stopped are processed); a new group with the default (StartEarliest)
// processes the whole history.
func TestStartOffsetLatestSkipsOldRecords(t *testing.T) {
	t.Parallel()
	const partitions, old = 2, 100
	e := newEnv(t, partitions)
	e.produce(t, uniqueMsgs("old", old, partitions))

	cfg := e.config("latest", recordEffect("latest"))
	cfg.StartOffset = consumer.StartLatest
	latest := e.start(context.Background(), cfg)
	// Until the member has its partitions positioned at their end, a probe
	// may land before that position and be skipped: probe every partition
	// until each has processed one.
	probe := 0
	testenv.Eventually(t, time.Minute, "a probe processed on every partition", func() bool {
		probed := e.count(t, `SELECT count(DISTINCT partition) FROM effects WHERE message_id LIKE 'probe-%'`)
		if probed < partitions {
			e.produce(t, uniqueMsgs(fmt.Sprintf("probe-%d", probe), partitions, partitions))
			probe++
		}
		return probed == partitions
	})
	e.produce(t, uniqueMsgs("new", 10, partitions))
	eventually(t, time.Minute, "the new records processed", func() bool {
		return e.count(t, `SELECT count(*) FROM effects WHERE message_id LIKE 'new-%'`) == 10
	})
	if n := e.count(t, `SELECT count(*) FROM effects WHERE message_id LIKE 'old-%'`); n != 0 {
		t.Fatalf("StartLatest processed %d records produced before the group started", n)
	}
	eventually(t, time.Minute, "offsets committed", func() bool { return e.committedLag(t) == 0 })
	if err := latest.stop(t); err != nil {
		t.Fatalf("Run: %v", err)
	}

	// Committed offsets win over StartLatest.
	e.produce(t, uniqueMsgs("while-stopped", 6, partitions))
	again := e.start(context.Background(), cfg)
	eventually(t, time.Minute, "records produced while the group was stopped processed", func() bool {
		return e.count(t, `SELECT count(*) FROM effects WHERE message_id LIKE 'while-stopped-%'`) == 6
	})
	if err := again.stop(t); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if n := e.count(t, `SELECT count(*) FROM effects WHERE message_id LIKE 'old-%'`); n != 0 {
		t.Fatalf("the restarted StartLatest group processed %d old records", n)
	}

	// The default: a new group reads the whole history.
	earliest := e.config("earliest", recordEffect("earliest"))
	earliest.Group = testenv.UniqueName("g-earliest")
	e.start(context.Background(), earliest)
	eventually(t, time.Minute, "the default group processed the history", func() bool {
		return e.count(t, `SELECT count(*) FROM effects WHERE member = 'earliest' AND message_id LIKE 'old-%'`) == old
	})
}
