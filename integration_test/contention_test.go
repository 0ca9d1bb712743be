package integration_test

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/consumer"
)

// TestContentionSpendsNoAttempts: a handler that loses to contention
// (deadlock, serialization failure, lock timeout) again and again is retried
// until it succeeds, with MaxAttempts 1, and never dead-lettered; the
// losses are counted as contention, not as retries of a failing record. It
// runs in every consumer mode (make test-modes).
func TestContentionSpendsNoAttempts(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	const n, contended, losses = 20, 6, 3
	codes := []string{"40P01", "40001", "55P03"}
	var mu sync.Mutex
	calls := map[string]int{}
	effect := recordEffect("m1")
	cfg := e.config("m1", func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		mu.Lock()
		calls[msg.ID]++
		call := calls[msg.ID]
		mu.Unlock()
		i, _ := strconv.Atoi(msg.ID[len("ct-"):])
		if i < contended && call <= losses {
			// As a handler sees it: a statement failed, wrapped on the way up.
			return fmt.Errorf("update balance: %w", &pgconn.PgError{Code: codes[call%len(codes)], Message: "simulated"})
		}
		return effect(ctx, tx, msg)
	})
	cfg.MaxAttempts = 1
	m := e.start(context.Background(), cfg)
	e.produce(t, uniqueMsgs("ct", n, 2))
	s := e.drain(t, m, n)
	if s.DeadLettered != 0 {
		t.Errorf("dead-lettered %d records; contention must never dead-letter", s.DeadLettered)
	}
	// A batch without conflict keys runs again whole when one of its
	// records loses, and counts all its records as having lost.
	if want := int64(contended * losses); s.Contention != want && (consumerMode.batchSize < 2 || s.Contention < want) {
		t.Errorf("Stats.Contention = %d, want %d (%d records, %d losses each)", s.Contention, want, contended, losses)
	}
	t.Logf("mode %s: %+v", consumerMode.name, s)
}

// TestBatchHandlerContentionRetriesTheBatch: a batch handler that loses to
// contention runs again with its whole batch (not record by record), and
// spends no attempt.
func TestBatchHandlerContentionRetriesTheBatch(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	const n = 40
	var mu sync.Mutex
	var calls, batches int
	cfg := e.config("m1", nil)
	cfg.KeyParallelism, cfg.BatchSize, cfg.MaxAttempts = 1, 100, 1
	cfg.BatchHandler = func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
		mu.Lock()
		calls++
		call := calls
		mu.Unlock()
		if call <= 2 {
			return &pgconn.PgError{Code: "40001", Message: "simulated serialization failure"}
		}
		for _, msg := range msgs {
			if _, err := tx.Exec(ctx, `INSERT INTO effects (message_id, partition, "offset", member) VALUES ($1, $2, $3, 'm1')`,
				msg.ID, msg.Partition, msg.Offset); err != nil {
				return err
			}
		}
		mu.Lock()
		batches++
		mu.Unlock()
		return nil
	}
	e.produce(t, uniqueMsgs("bc", n, 1)) // all there before the member starts: one batch
	m := e.start(context.Background(), cfg)
	s := e.drain(t, m, n)
	if s.DeadLettered != 0 || s.Contention == 0 {
		t.Errorf("stats %+v: want contention counted and nothing dead-lettered", s)
	}
	mu.Lock()
	defer mu.Unlock()
	// A batch that lost would, as a failed batch, run its records one by
	// one: 40 more handler calls. Retried as a batch, it commits in few.
	if calls > 2+4 {
		t.Errorf("batch handler ran %d times for %d records; a lost batch must run again as a batch", calls, n)
	}
}

// TestContendedMembersMakeProgress: three members of one group, in batch
// mode, whose records (keyed apart from the rows they write) move units
// between 10 hot accounts, each record locking its two accounts in its own
// order: the workload on which batch transactions of different partitions
// and members deadlock. With ConflictKeys naming the accounts, no
// transaction of theirs ever loses to contention; without, Postgres breaks
// deadlocks, and every record is still applied exactly once, none
// dead-lettered (MaxAttempts 1), the losses counted as contention.
//
// Not parallel: it reads the database's deadlock counter, which other tests
// of this package would share.
func TestContendedMembersMakeProgress(t *testing.T) {
	for _, withKeys := range []bool{true, false} {
		t.Run(fmt.Sprintf("conflict_keys=%v", withKeys), func(t *testing.T) {
			contendedMembers(t, withKeys)
		})
	}
}

func contendedMembers(t *testing.T, withKeys bool) {
	const (
		partitions = 6
		accounts   = 10
		records    = 1800
	)
	e := newEnv(t, partitions)
	ctx := context.Background()
	if _, err := e.db.Pool.Exec(ctx, `CREATE TABLE accounts (id int PRIMARY KEY, units bigint NOT NULL, moves bigint NOT NULL DEFAULT 0);
		INSERT INTO accounts SELECT g, 0 FROM generate_series(0, 9) g`); err != nil {
		t.Fatal(err)
	}
	// Record i moves 1 unit from account from(i) to to(i), the two
	// written in that order.
	from := func(i int) int { return i % accounts }
	to := func(i int) int { return (i%accounts + 1 + (i/accounts)%(accounts-1)) % accounts }
	pair := func(id string) (int, int) {
		i, _ := strconv.Atoi(id[len("cm-"):])
		return from(i), to(i)
	}
	msgs := make([]msg, records)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range msgs {
		if from(i) == to(i) {
			t.Fatalf("record %d moves between one account", i)
		}
		msgs[i] = msg{id: fmt.Sprintf("cm-%d", i), partition: int32(rng.IntN(partitions)), key: fmt.Sprintf("order-%d", i)}
	}
	e.produce(t, msgs)

	// deadlock_timeout of 100ms: Postgres finds the cycles sooner than
	// its default second, so the run without keys stays short.
	deadlocksBefore := deadlocks(t, e)
	var members []*member
	for k := range 3 {
		pool := e.memberPool(t, 4, map[string]string{"deadlock_timeout": "100ms"})
		name := fmt.Sprintf("m%d", k)
		effect := recordEffect(name)
		cfg := e.config(name, func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			a, b := pair(msg.ID)
			for _, acct := range []struct{ id, delta int }{{a, -1}, {b, +1}} {
				if _, err := tx.Exec(ctx, `UPDATE accounts SET units = units + $2, moves = moves + 1 WHERE id = $1`, acct.id, acct.delta); err != nil {
					return err
				}
			}
			return effect(ctx, tx, msg)
		})
		cfg.Pool, cfg.BatchSize, cfg.KeyParallelism, cfg.MaxAttempts = pool, 50, 1, 1
		if withKeys {
			cfg.ConflictKeys = func(msg *consumer.Message) []string {
				a, b := pair(msg.ID)
				return []string{"account:" + strconv.Itoa(a), "account:" + strconv.Itoa(b)}
			}
		}
		members = append(members, e.start(ctx, cfg))
	}
	start := time.Now()
	eventually(t, 2*time.Minute, "every record applied", func() bool {
		return e.count(t, `SELECT count(*) FROM effects`) >= records
	})
	elapsed := time.Since(start)
	var total consumer.Stats
	for _, m := range members {
		if err := m.stop(t); err != nil {
			t.Fatal(err)
		}
		s := m.c.Stats()
		total.Processed += s.Processed
		total.Contention += s.Contention
		total.DeadLettered += s.DeadLettered
		total.Retries += s.Retries
		total.Batches += s.Batches
	}
	e.assertExactlyOnce(t, records)
	if n := e.count(t, `SELECT sum(units) FROM accounts`); n != 0 {
		t.Errorf("units summed over accounts = %d, want 0: a move applied half", n)
	}
	if n := e.count(t, `SELECT sum(moves) FROM accounts`); n != 2*records {
		t.Errorf("account writes = %d, want %d", n, 2*records)
	}
	if total.DeadLettered != 0 {
		t.Errorf("%d records dead-lettered; contention must never dead-letter", total.DeadLettered)
	}
	if withKeys && total.Contention != 0 {
		t.Errorf("%d records lost to contention although their conflict keys were locked in order", total.Contention)
	}
	t.Logf("conflict keys %v: %d records in %s (%.0f/s) by 3 members, %d batches; contention %d, database deadlocks %d, retries %d",
		withKeys, records, elapsed.Round(time.Millisecond), float64(records)/elapsed.Seconds(), total.Batches,
		total.Contention, deadlocks(t, e)-deadlocksBefore, total.Retries)
}

// memberPool is a pool of the env's database and schema for one member of
// a group, as each process of a group has one, with maxConns connections
// and the given session parameters.
func (e *env) memberPool(t *testing.T, maxConns int32, params map[string]string) *pgxpool.Pool {
	t.Helper()
	pcfg, err := pgxpool.ParseConfig(e.db.URL)
	if err != nil {
		t.Fatal(err)
	}
	pcfg.ConnConfig.RuntimeParams["search_path"] = e.db.Schema
	maps.Copy(pcfg.ConnConfig.RuntimeParams, params)
	pcfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// deadlocks is the database's count of deadlocks Postgres broke, as of the
// latest statistics flush (up to a second behind).
func deadlocks(t *testing.T, e *env) int64 {
	t.Helper()
	return e.count(t, `SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()`)
}

// drain waits until n records have their effect, stops m, checks that each
// has exactly one, and returns m's stats.
func (e *env) drain(t *testing.T, m *member, n int64) consumer.Stats {
	t.Helper()
	eventually(t, 30*time.Second, "every record applied", func() bool {
		return e.count(t, `SELECT count(*) FROM effects`) >= n
	})
	if err := m.stop(t); err != nil {
		t.Fatal(err)
	}
	e.assertExactlyOnce(t, n)
	return m.c.Stats()
}

// TestConflictingTransactionsTakeTurnsInTheMember: two records of one
// member, on two partitions, that share a conflict key. While the first
// one's handler runs, the second waits for its turn in the process: it has
// asked Postgres for no lock and holds no transaction
// slot, and Stats.TurnWaits and the oncely.consumer.turn_waits metric count
// it. A third record, of another key, produced then, commits meanwhile
// although the member has only two slots (Concurrency 2). Then all commit,
// once each. It runs in every consumer mode (make test-modes).
func TestConflictingTransactionsTakeTurnsInTheMember(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 3)
	app := "oncely-turns-" + e.group
	pool := e.memberPool(t, 4, map[string]string{"application_name": app})
	entered := make(chan string, 2)
	release := make(chan struct{})
	effect := recordEffect("m1")
	hot := func(msg *consumer.Message) bool { return strings.HasPrefix(msg.ID, "tt-hot") }
	cfg := e.config("m1", func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if hot(msg) {
			entered <- msg.ID
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return effect(ctx, tx, msg)
	})
	tl := newTel(t)
	cfg.Pool, cfg.MeterProvider, cfg.Concurrency = pool, tl.mp, 2
	cfg.ConflictKeys = func(msg *consumer.Message) []string {
		if hot(msg) {
			return []string{"hot-row"}
		}
		return []string{"cold-row"}
	}
	e.produce(t, []msg{{id: "tt-hot-0", partition: 0, key: "a"}, {id: "tt-hot-1", partition: 1, key: "b"}})
	m := e.start(context.Background(), cfg)

	var first string
	select {
	case first = <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("no handler ran within 30s")
	}
	eventually(t, 30*time.Second, "the other record waiting for its turn", func() bool {
		return m.c.Stats().TurnWaits >= 1
	})
	select {
	case second := <-entered:
		t.Fatalf("%s ran while %s, which shares its conflict key, was running", second, first)
	default:
	}
	// Only the conflict keys take advisory locks: the transaction that
	// runs holds one; the one waiting its turn has not asked for it.
	// (Other statements of the member, such as its partition-owner rows,
	// may be open meanwhile.)
	if n := e.count(t, `SELECT count(DISTINCT pid) FROM pg_locks l JOIN pg_stat_activity a USING (pid) WHERE a.application_name = $1 AND l.locktype = 'advisory'`, app); n != 1 {
		t.Errorf("%d transactions of the member hold or wait for a conflict lock, want 1: the one waiting its turn must not have begun", n)
	}
	if n := e.count(t, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) WHERE a.application_name = $1 AND NOT l.granted`, app); n != 0 {
		t.Errorf("%d locks of the member waited for in Postgres, want 0", n)
	}
	// One slot runs the first record; the waiting one holds none, so the
	// cold record takes the other.
	e.produce(t, []msg{{id: "tt-cold", partition: 2, key: "c"}})
	eventually(t, 30*time.Second, "the record of another key committed while the first ran", func() bool {
		return e.count(t, `SELECT count(*) FROM effects WHERE message_id = 'tt-cold'`) == 1
	})
	close(release)
	s := e.drain(t, m, 3)
	if s.TurnWaits < 1 || s.Contention != 0 || s.DeadLettered != 0 {
		t.Errorf("stats %+v: want a turn waited, no contention, nothing dead-lettered", s)
	}
	if got := tl.sum(t, "oncely.consumer.turn_waits"); got != s.TurnWaits {
		t.Errorf("turn_waits metric = %d, want Stats.TurnWaits, %d", got, s.TurnWaits)
	}
}
