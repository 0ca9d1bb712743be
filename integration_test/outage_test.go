package integration_test

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/migrations"
)

// The database goes away mid-stream: the test's own Postgres container is
// stopped while records flow and started again on the same host port. The
// consumer waits for it: it reports not ready, commits nothing (neither a
// transaction nor an offset), keeps running, and after the restart becomes
// ready again and applies every record exactly once.
//
// It needs a container engine (it stops its database); with only
// DATABASE_URL it is skipped. `make test-containers` runs it.
func TestPostgresOutage(t *testing.T) {
	t.Parallel()
	const partitions, half = 4, 2000
	pg := testenv.PostgresContainer(t)
	e := newOutageEnv(t, testenv.PostgresAt(t, pg.URL), partitions)

	// The phase is written with each effect: 0 before the stop, 1 from the
	// stop on, 2 from the restart on. A row of phase < 2 committed before the
	// database went down.
	var phase atomic.Int32
	handler := func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO effects (message_id, partition, "offset", member, phase)
			VALUES ($1, $2, $3, 'a', $4)`, msg.ID, msg.Partition, msg.Offset, phase.Load())
		return err
	}
	committed := func() []int64 {
		out := make([]int64, partitions)
		for p := range out {
			out[p] = e.committedOffset(t, int32(p))
		}
		return out
	}
	m := e.start(context.Background(), e.config("a", handler))
	running := func(when string) {
		t.Helper()
		select {
		case err := <-m.done:
			m.done <- err
			t.Fatalf("consumer.Run returned %s: %v", when, err)
		default:
		}
	}
	moreRetries := func(n int64) {
		t.Helper()
		r := m.c.Stats().Retries
		eventually(t, time.Minute, fmt.Sprintf("%d more retries", n), func() bool { return m.c.Stats().Retries >= r+n })
	}

	e.produce(t, uniqueMsgs("before", half, partitions))
	eventually(t, time.Minute, "the consumer ready and mid-stream", func() bool {
		return m.c.Ready() && m.c.Stats().Processed >= half/4
	})

	phase.Store(1)
	atStop := m.c.Stats()
	start := time.Now()
	timeout := 10 * time.Second
	if err := pg.Stop(context.Background(), &timeout); err != nil {
		t.Fatalf("stop the postgres container: %v", err)
	}
	t.Logf("postgres stopped in %s; the consumer had processed %d records when the stop began, %d when it ended",
		time.Since(start).Round(time.Millisecond), atStop.Processed, m.c.Stats().Processed)
	e.produce(t, uniqueMsgs("during", half, partitions)) // Kafka is up, the database is not
	eventually(t, 30*time.Second, "the consumer to report not ready", func() bool { return !m.c.Ready() })

	// Down: attempts keep failing and are retried; none commits, and the
	// committed offsets stay where the last durable records put them.
	moreRetries(100) // long enough for marks made before the stop to reach Kafka
	downStats, downOffsets := m.c.Stats(), committed()
	moreRetries(100)
	if s := m.c.Stats(); s.Processed != downStats.Processed || s.Duplicates != downStats.Duplicates {
		t.Errorf("records committed while the database was down: stats went from %+v to %+v", downStats, s)
	}
	if offs := committed(); !slices.Equal(offs, downOffsets) {
		t.Errorf("committed offsets moved while the database was down: %v, then %v", downOffsets, offs)
	}
	if m.c.Ready() {
		t.Error("the consumer reports ready while the database is down")
	}
	running("while the database was down")
	t.Logf("down for %s: stats %+v, committed offsets %v", time.Since(start).Round(time.Millisecond), m.c.Stats(), downOffsets)

	phase.Store(2)
	restart := time.Now()
	if err := pg.Start(context.Background()); err != nil {
		t.Fatalf("start the postgres container again: %v", err)
	}
	eventually(t, time.Minute, "the consumer to report ready again", m.c.Ready)
	t.Logf("ready again %s after the restart began", time.Since(restart).Round(time.Millisecond))
	eventually(t, 2*time.Minute, "all records applied and committed", func() bool {
		return e.count(t, `SELECT count(*) FROM effects`) == 2*half && e.committedLag(t) == 0
	})
	e.assertExactlyOnce(t, 2*half)

	// The offsets Kafka had during the outage covered only records whose
	// effects had committed before it.
	for p, off := range downOffsets {
		if n := e.count(t, `SELECT count(DISTINCT "offset") FROM effects
			WHERE partition = $1 AND "offset" < $2 AND phase < 2`, p, off); n != off {
			t.Errorf("partition %d: offset %d was committed during the outage, but only %d records below it had effects from before it",
				p, off, n)
		}
	}
	running("after the restart")
	if err := m.stop(t); err != nil {
		t.Fatalf("Run: %v", err)
	}
	t.Logf("final stats %+v", m.c.Stats())
}

// newOutageEnv is newEnv on db (the test's own server), with a phase column
// in the effect table.
func newOutageEnv(t *testing.T, db *testenv.DB, partitions int32) *env {
	t.Helper()
	ctx := context.Background()
	m, err := migrations.New(db.Pool, migrations.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Up(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE effects (
		seq bigserial PRIMARY KEY, message_id text NOT NULL, partition int NOT NULL,
		"offset" bigint NOT NULL, member text NOT NULL, phase int NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return newKafkaEnv(t, db, testenv.NewKafka(t), partitions)
}
