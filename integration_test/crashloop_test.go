package integration_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/internal/testhook"
)

// The crash-loop worker runs in a child process (this test binary, run again
// with crashLoopChildEnv set): its handler (or its KeyFunc) exits the
// process on the poison record, as a handler (or a decoder) that runs out of
// memory or calls os.Exit would.
const (
	crashLoopChildEnv = "ONCELY_CRASHLOOP_CHILD" // brokers|database url|schema|topic|group|poison id|limit|kill in
	crashLoopExitCode = 3
)

// Where the child dies on the poison.
const (
	killInHandler = "handler"
	killInKeyFunc = "keyfunc" // the KeyFunc returns the record's value, the message id the tests produce
)

// TestCrashLoopChildWorker is the child process's body; it is skipped in an
// ordinary run.
func TestCrashLoopChildWorker(t *testing.T) {
	spec := os.Getenv(crashLoopChildEnv)
	if spec == "" {
		t.Skip("runs only as the child process of TestCrashLoopRecordIsDeadLettered")
	}
	f := strings.Split(spec, "|")
	if len(f) != 8 {
		t.Fatalf("%s=%q: want 8 fields", crashLoopChildEnv, spec)
	}
	limit, err := strconv.Atoi(f[6])
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	pool, err := testenv.NewPool(ctx, f[1], f[2], 8)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	e := &env{t: t, db: &testenv.DB{URL: f[1], Schema: f[2], Pool: pool},
		kafka: &testenv.Kafka{Brokers: strings.Split(f[0], ",")}, topic: f[3], group: f[4]}
	poison := f[5]
	apply := recordEffect("child")
	cfg := e.config("child", func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.ID == poison && f[7] == killInHandler {
			os.Exit(crashLoopExitCode) // what no recover can catch
		}
		return apply(ctx, tx, m)
	})
	if f[7] == killInKeyFunc {
		cfg.KeyFunc = func(rec *kgo.Record) (string, error) {
			if string(rec.Value) == poison {
				os.Exit(crashLoopExitCode)
			}
			return string(rec.Value), nil
		}
	}
	cfg.CrashLoopLimit = limit
	// Static membership: each restart takes the partitions back at once,
	// without waiting for the dead member's session to time out.
	cfg.InstanceID = "crashloop-worker"
	c, err := consumer.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Run(ctx); err != nil {
		t.Fatal(err)
	}
}

// child is one run of the crash-loop worker.
type child struct {
	cmd  *exec.Cmd
	out  *bytes.Buffer
	done chan struct{}
	err  error
}

func (e *env) startCrashLoopChild(t *testing.T, poison string, limit int, killIn string) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashLoopChildWorker$", "-test.count=1")
	cmd.Env = append(os.Environ(), crashLoopChildEnv+"="+strings.Join([]string{
		strings.Join(e.kafka.Brokers, ","), e.db.URL, e.db.Schema, e.topic, e.group, poison, strconv.Itoa(limit), killIn}, "|"))
	ch := &child{cmd: cmd, out: &bytes.Buffer{}, done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = ch.out, ch.out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(ch.done)
		ch.err = cmd.Wait()
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-ch.done
	})
	return ch
}

func (ch *child) exitCode() int {
	var ee *exec.ExitError
	if errors.As(ch.err, &ee) {
		return ee.ExitCode()
	}
	if ch.err != nil {
		return -1
	}
	return 0
}

// A record whose handler kills the process crash-loops the worker until the
// partition's probe has seen it kill CrashLoopLimit processes; the next
// start dead-letters it (class crash_loop) and the partition moves on.
// Every other record is applied once, the poison is in the dead-letter topic
// once with its provenance, and after a clean shutdown no partition is left
// marked as owned.
func TestCrashLoopRecordIsDeadLettered(t *testing.T) {
	t.Parallel()
	testCrashLoop(t, killInHandler)
}

// A record whose KeyFunc kills the process (a decoder that runs out of
// memory) is caught the same way: the probe marks a record before it works
// out its id, so each death counts against the poison, and the poison,
// once at the limit, is dead-lettered without its KeyFunc running again,
// under the id an undecodable record gets (topic/partition/offset).
func TestCrashLoopInKeyFuncIsDeadLettered(t *testing.T) {
	t.Parallel()
	testCrashLoop(t, killInKeyFunc)
}

func testCrashLoop(t *testing.T, killIn string) {
	const limit = 2
	e := newEnv(t, 2)
	e.createDLQTopic(t)
	var msgs []msg
	for i := range 10 {
		msgs = append(msgs, msg{id: fmt.Sprint("p0-before-", i), partition: 0, key: fmt.Sprint("k-", i%4)})
	}
	msgs = append(msgs, msg{id: "poison", partition: 0, key: "k-1"})
	const poisonOffset = 10
	poisonID := "poison"
	if killIn == killInKeyFunc {
		poisonID = fmt.Sprintf("%s/0/%d", e.topic, poisonOffset) // its KeyFunc never returned
	}
	for i := range 10 {
		msgs = append(msgs, msg{id: fmt.Sprint("p0-after-", i), partition: 0, key: fmt.Sprint("k-", i%4)})
	}
	for i := range 20 {
		msgs = append(msgs, msg{id: fmt.Sprint("p1-", i), partition: 1, key: fmt.Sprint("k-", i%4)})
	}
	e.produce(t, msgs)
	goods := int64(len(msgs) - 1)

	caughtUp := func() bool {
		return e.count(t, `SELECT count(*) FROM inbox WHERE message_id = $1 AND outcome = 'dead_lettered'`, poisonID) == 1 &&
			e.count(t, `SELECT count(*) FROM effects`) == goods && e.committedLag(t) == 0
	}
	deaths := e.restartUntilCaughtUp(t, "poison", limit, killIn, caughtUp)
	// The first death came outside a probe, and counts against no record
	// (nor does, in batch mode, the death in the replay of its batch); each
	// later one counted against the poison.
	if want := crashLoopDeaths(limit, killIn); deaths != want {
		t.Errorf("the worker died %d times before the poison was dead-lettered, want %d", deaths, want)
	}

	e.assertExactlyOnce(t, goods)
	if n := e.count(t, `SELECT count(*) FROM effects WHERE message_id = 'poison'`); n != 0 {
		t.Errorf("the poison has %d effects", n)
	}
	entries := e.dlqEntries(t)
	if len(entries) != 1 || entries[0].Err != nil || entries[0].Copies != 1 {
		t.Fatalf("dead-letter topic: %d entries (%+v), want the poison once", len(entries), entries)
	}
	info := entries[0].Info
	if info.MessageID != poisonID || info.Class != dlq.ClassCrashLoop || info.Topic != e.topic || info.Partition != 0 ||
		info.Offset != poisonOffset || info.Group != e.group || info.Attempts != limit || info.Timestamp.IsZero() {
		t.Errorf("dead letter %+v: want %s, class crash_loop, from %s/0@%d, group %s, %d deaths", info, poisonID, e.topic, poisonOffset, e.group, limit)
	}
	if want := fmt.Sprintf("died %d times", limit); !strings.Contains(info.Error, want) {
		t.Errorf("dead letter error %q does not say %q", info.Error, want)
	}
	if string(entries[0].Record.Value) != "poison" || string(entries[0].Record.Key) != "k-1" {
		t.Errorf("dead letter key/value %q/%q, want the poison's", entries[0].Record.Key, entries[0].Record.Value)
	}
	if o, err := dedup.MustNew(e.db.Schema).Lookup(context.Background(), e.db.Pool, e.group, poisonID); err != nil || o != dedup.DeadLettered {
		t.Errorf("inbox outcome of the poison = %q, %v; want dead_lettered", o, err)
	}
	if off := e.committedOffset(t, 0); off != int64(len(msgs)-20) {
		t.Errorf("partition 0's committed offset is %d, want %d: past the poison and the records after it", off, len(msgs)-20)
	}
	if n := e.count(t, `SELECT count(*) FROM partition_owners`); n != 0 {
		t.Errorf("%d partitions still marked as owned after a clean shutdown: %s", n, e.ownerRows(t))
	}
}

// restartUntilCaughtUp runs crash-loop workers one after another, each
// until it dies on the poison or caughtUp holds, then stops the last one
// cleanly. It returns how many died.
func (e *env) restartUntilCaughtUp(t *testing.T, poison string, limit int, killIn string, caughtUp func() bool) int {
	t.Helper()
	deaths := 0
	for {
		if want := crashLoopDeaths(limit, killIn); deaths > want {
			t.Fatalf("the worker died %d times; the poison should have been dead-lettered after %d", deaths, want)
		}
		ch := e.startCrashLoopChild(t, poison, limit, killIn)
		var exited bool
		testenv.Eventually(t, 2*time.Minute, "the worker to die on the poison or to catch up past it", func() bool {
			select {
			case <-ch.done:
				exited = true
				return true
			default:
				return caughtUp()
			}
		})
		if exited {
			if code := ch.exitCode(); code != crashLoopExitCode {
				t.Fatalf("the worker exited with %v (code %d), not on the poison; its output:\n%s", ch.err, code, ch.out)
			}
			deaths++
			continue
		}
		// Caught up: a clean shutdown.
		if err := ch.cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		select {
		case <-ch.done:
		case <-time.After(time.Minute):
			t.Fatal("the worker did not stop within a minute of SIGTERM")
		}
		if ch.err != nil {
			t.Fatalf("the last worker exited with %v; its output:\n%s", ch.err, ch.out)
		}
		break
	}
	return deaths
}

// crashLoopDeaths is how many processes a record that kills every one of
// them kills before it is dead-lettered: the first, outside a probe, counts
// against no record; in batch and per-key mode, the next replays the dead
// owner's window as this mode runs records, and that death counts against
// no record either; then limit deaths in probes, one record at a time.
// With a KeyFunc there is no replay: the inbox cannot be asked which
// records finished, so nothing says where the dead owner's window began.
func crashLoopDeaths(limit int, killIn string) int {
	if killIn != killInKeyFunc && (consumerMode.batchSize > 1 || consumerMode.keyParallelism > 1) {
		return limit + 2
	}
	return limit + 1
}

// ownerRows describes the partition_owners rows, for a failure message.
func (e *env) ownerRows(t *testing.T) string {
	t.Helper()
	var rows string
	if err := e.db.Pool.QueryRow(context.Background(), `SELECT coalesce(string_agg(format('partition %s (deaths %s, running offset %s, replay end %s, suspect %s with %s kills)',
		partition, deaths, coalesce(running_offset::text, 'none'), coalesce(replay_end::text, 'none'), coalesce(suspect_offset::text, 'none'), suspect_kills),
		'; ' ORDER BY partition), 'none') FROM partition_owners`).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	return rows
}

// Partitions that leave a member cleanly (a graceful shutdown, a rebalance
// to a second member) never count as a death, even when the member left in
// the middle of a probe, with a record marked and running: with
// CrashLoopLimit 1 that record would otherwise be dead-lettered at the next
// start. Only B's simulated crash puts partitions in probe.
func TestCleanExitsNeverCountAsCrashes(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	e.createDLQTopic(t)
	withLimit := func(cfg consumer.Config) consumer.Config {
		cfg.CrashLoopLimit = 1
		return cfg
	}

	// A dies (simulated: it stops at once and lets nothing go) after
	// committing a record on each partition.
	hooks := &testhook.Consumer{AfterCommit: func(rec *kgo.Record) error {
		if strings.HasPrefix(string(rec.Value), "crash") {
			return testhook.ErrCrash
		}
		return nil
	}}
	e.produce(t, []msg{{id: "first-0", partition: 0}, {id: "first-1", partition: 1}})
	a := e.start(context.Background(), withLimit(e.config("a", recordEffect("a"))))
	eventually(t, time.Minute, "A to process a record on each partition", func() bool { return a.c.Stats().Processed == 2 })
	if err := a.stop(t); err != nil {
		t.Fatal(err)
	}
	if n := e.count(t, `SELECT count(*) FROM partition_owners`); n != 0 {
		t.Fatalf("%d partitions marked as owned after A's graceful shutdown", n)
	}
	// A graceful shutdown is no death: B starts without a probe.
	b := e.start(testhook.WithConsumer(context.Background(), hooks), withLimit(e.config("b", recordEffect("b"))))
	e.produce(t, []msg{{id: "second-0", partition: 0}, {id: "second-1", partition: 1}})
	eventually(t, time.Minute, "B to process a record on each partition", func() bool { return b.c.Stats().Processed == 2 })
	if s := b.c.Stats(); s.CrashProbes != 0 {
		t.Fatalf("B started %d partitions in probe after A's graceful shutdown", s.CrashProbes)
	}
	eventually(t, time.Minute, "B's offsets to be committed", func() bool { return e.committedLag(t) == 0 })
	e.produce(t, []msg{{id: "crash", partition: 0}})
	if err := b.wait(t, time.Minute); !errors.Is(err, testhook.ErrCrash) {
		t.Fatalf("B's Run = %v, want the simulated crash", err)
	}

	// C starts after B's death: both partitions in probe. Its handler
	// blocks on "slow" until C's shutdown abandons it, with "slow" marked
	// as the record the probe runs; partition 1's probe waits its turn.
	entered := make(chan struct{})
	var once sync.Once
	slowC := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.ID == "slow" {
			once.Do(func() { close(entered) })
			<-ctx.Done()
			return ctx.Err()
		}
		return recordEffect("c")(ctx, tx, m)
	}
	e.produce(t, []msg{{id: "slow", partition: 0}, {id: "after-slow", partition: 1}})
	// As if B had died probing: C probes one record at a time, marking
	// slow, in every mode (a first death would replay B's window, unmarked).
	if _, err := e.db.Pool.Exec(context.Background(), `UPDATE partition_owners SET replay_end = -1`); err != nil {
		t.Fatal(err)
	}
	cfgC := withLimit(e.config("c", slowC))
	cfgC.ShutdownTimeout = 2 * time.Second
	c := e.start(context.Background(), cfgC)
	c.await(t, entered)
	eventually(t, time.Minute, "C to start both partitions in probe", func() bool { return c.c.Stats().CrashProbes == 2 })
	if n := e.count(t, `SELECT count(*) FROM partition_owners WHERE partition = 0 AND running_offset = 3`); n != 1 {
		t.Fatalf("the probe did not mark slow (offset 3) before running it: %s", e.ownerRows(t))
	}
	if err := c.stop(t); err != nil {
		t.Fatal(err)
	}

	// D and then E (a second member: a rebalance moves a partition to it)
	// start with no probe, and slow is processed, not dead-lettered.
	d := e.start(context.Background(), withLimit(e.config("d", recordEffect("d"))))
	e.produce(t, []msg{{id: "d-0", partition: 0}, {id: "d-1", partition: 1}})
	eventually(t, time.Minute, "D to hold both partitions and process slow", func() bool {
		return e.count(t, `SELECT count(*) FROM effects WHERE message_id IN ('slow', 'after-slow', 'd-0', 'd-1')`) == 4 &&
			d.c.Stats().PartitionsHeld == 2
	})
	if n := e.count(t, `SELECT count(*) FROM effects WHERE message_id = 'slow' AND member = 'd'`); n != 1 {
		t.Fatalf("slow was not processed by D")
	}
	ee := e.start(context.Background(), withLimit(e.config("e", recordEffect("e"))))
	eventually(t, time.Minute, "the rebalance to move a partition from D to E", func() bool { return d.c.Stats().PartitionsHeld == 1 })
	var late []msg
	for i := range 10 {
		late = append(late, msg{id: fmt.Sprint("late-", i), partition: int32(i % 2)})
	}
	e.produce(t, late)
	eventually(t, time.Minute, "D and E to catch up", func() bool {
		return e.count(t, `SELECT count(*) FROM effects WHERE message_id LIKE 'late-%'`) == 10 && e.committedLag(t) == 0
	})
	if ds, es := d.c.Stats(), ee.c.Stats(); ds.CrashProbes != 0 || es.CrashProbes != 0 || ds.CrashLoops+es.CrashLoops != 0 {
		t.Errorf("after clean exits: D %d probes, %d crash loops; E %d probes, %d crash loops; want none",
			ds.CrashProbes, ds.CrashLoops, es.CrashProbes, es.CrashLoops)
	}
	if es := ee.c.Stats(); es.Processed == 0 {
		t.Error("E processed nothing: the rebalance gave it no partition with records")
	}
	for _, m := range []*member{d, ee} {
		if err := m.stop(t); err != nil {
			t.Fatal(err)
		}
	}
	if n := len(e.dlqEntries(t)); n != 0 {
		t.Errorf("%d records dead-lettered; clean exits must never count", n)
	}
	e.assertExactlyOnce(t, 2+2+1+2+2+10) // first-*, second-*, crash, slow, after-slow, d-*, late-*
	if n := e.count(t, `SELECT count(*) FROM partition_owners`); n != 0 {
		t.Errorf("%d partitions still marked as owned after clean shutdowns", n)
	}
}

// A schema migrated before partition_owners.in_flight (0008) existed fails
// Run at start-up, naming the column.
func TestMissingInFlightColumnFailsAtStart(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	if _, err := e.db.Pool.Exec(context.Background(), `ALTER TABLE partition_owners DROP COLUMN in_flight`); err != nil {
		t.Fatal(err)
	}
	assertNotMigrated(t, e.config("a", recordEffect("a")), `partition_owners".in_flight`)
}

// A schema migrated before partition_owners existed fails Run at start-up,
// naming the table, unless crash-loop detection is off (CrashLoopLimit -1):
// then the consumer needs only the inbox.
func TestMissingPartitionOwnersFailsAtStart(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	if _, err := e.db.Pool.Exec(context.Background(), `DROP TABLE partition_owners`); err != nil {
		t.Fatal(err)
	}
	assertNotMigrated(t, e.config("a", recordEffect("a")), "partition_owners", "in_flight")

	cfg := e.config("b", recordEffect("b"))
	cfg.CrashLoopLimit = -1
	b := e.start(context.Background(), cfg)
	e.produce(t, uniqueMsgs("m", 5, 1))
	eventually(t, time.Minute, "the consumer without crash-loop detection to process the records", func() bool {
		return e.count(t, `SELECT count(*) FROM effects`) == 5
	})
	if err := b.stop(t); err != nil {
		t.Fatal(err)
	}
}

// Deaths while a partition is idle count against no record: partition 0's
// owner dies three times (a crash on partition 1), once after finishing a
// record of partition 0 and twice with nothing to do on it, its committed
// offset the same each time. With CrashLoopLimit 1 the records that come
// later are processed, none dead-lettered, although the partition starts
// in probe.
func TestIdleCrashesDeadLetterNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	e.createDLQTopic(t)
	config := func(name string) consumer.Config {
		cfg := e.config(name, recordEffect(name))
		cfg.CrashLoopLimit = 1
		return cfg
	}
	e.produce(t, []msg{{id: "idle-0", partition: 0}})
	for i := range 3 {
		crash := fmt.Sprint("crash-", i)
		hooks := &testhook.Consumer{AfterCommit: func(rec *kgo.Record) error {
			if string(rec.Value) == crash {
				return testhook.ErrCrash
			}
			return nil
		}}
		m := e.start(testhook.WithConsumer(context.Background(), hooks), config(fmt.Sprint("m", i)))
		eventually(t, time.Minute, "partition 0's record to be processed and committed", func() bool {
			return e.count(t, `SELECT count(*) FROM effects WHERE message_id = 'idle-0'`) == 1 && e.committedOffset(t, 0) == 1
		})
		e.produce(t, []msg{{id: crash, partition: 1}})
		if err := m.wait(t, time.Minute); !errors.Is(err, testhook.ErrCrash) {
			t.Fatalf("member %d: Run = %v, want the simulated crash", i, err)
		}
	}
	last := e.start(context.Background(), config("last"))
	var late []msg
	for i := range 5 {
		late = append(late, msg{id: fmt.Sprint("late-", i), partition: 0})
	}
	e.produce(t, late)
	eventually(t, time.Minute, "the late records to be processed", func() bool {
		return e.count(t, `SELECT count(*) FROM effects WHERE message_id LIKE 'late-%'`) == 5 && e.committedLag(t) == 0
	})
	if s := last.c.Stats(); s.CrashProbes == 0 || s.CrashLoops != 0 || s.DeadLettered != 0 {
		t.Errorf("last member: %d probes, %d crash loops, %d dead letters; want a probe and no dead letter", s.CrashProbes, s.CrashLoops, s.DeadLettered)
	}
	if err := last.stop(t); err != nil {
		t.Fatal(err)
	}
	if n := len(e.dlqEntries(t)); n != 0 {
		t.Errorf("%d records dead-lettered after deaths while the partition was idle", n)
	}
	e.assertExactlyOnce(t, 1+3+5) // idle-0, crash-*, late-*
}

// A member that holds a partition with nothing to process on it (every
// record committed) still owns it: a clean exit deletes its row. A dies,
// holding both partitions, after partition 0's last record is committed; B
// is given both, has records only on partition 1, and stops cleanly. No row
// is left, so C, the next start, probes neither partition: a row left by A
// would put partition 0 in probe again, and count A's death a second time
// against whatever A was running.
func TestCleanExitAfterCrashForgetsPartitionsWithoutRecords(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	e.createDLQTopic(t)
	hooks := &testhook.Consumer{AfterCommit: func(rec *kgo.Record) error {
		if string(rec.Value) == "crash" {
			return testhook.ErrCrash
		}
		return nil
	}}
	e.produce(t, []msg{{id: "first-0", partition: 0}})
	a := e.start(testhook.WithConsumer(context.Background(), hooks), e.config("a", recordEffect("a")))
	eventually(t, time.Minute, "A to process and commit partition 0's record", func() bool {
		return e.count(t, `SELECT count(*) FROM effects WHERE message_id = 'first-0'`) == 1 && e.committedOffset(t, 0) == 1
	})
	e.produce(t, []msg{{id: "crash", partition: 1}})
	if err := a.wait(t, time.Minute); !errors.Is(err, testhook.ErrCrash) {
		t.Fatalf("A's Run = %v, want the simulated crash", err)
	}
	if n := e.count(t, `SELECT count(*) FROM partition_owners`); n != 2 {
		t.Fatalf("%d partitions marked as owned after A's crash, want both", n)
	}

	// B: partition 0 has no record left for it; partition 1 has crash again
	// (its offset was not committed), a duplicate now.
	b := e.start(context.Background(), e.config("b", recordEffect("b")))
	eventually(t, time.Minute, "B to commit partition 1 past crash", func() bool { return e.committedLag(t) == 0 })
	if err := b.stop(t); err != nil {
		t.Fatal(err)
	}
	if s := b.c.Stats(); s.CrashProbes != 2 {
		t.Errorf("B started %d partitions in probe, want both: A died holding them", s.CrashProbes)
	}
	if n := e.count(t, `SELECT count(*) FROM partition_owners`); n != 0 {
		t.Fatalf("%d partitions still marked as owned after B's clean shutdown: %s", n, e.ownerRows(t))
	}

	c := e.start(context.Background(), e.config("c", recordEffect("c")))
	e.produce(t, []msg{{id: "c-0", partition: 0}, {id: "c-1", partition: 1}})
	eventually(t, time.Minute, "C to process its records", func() bool {
		return e.count(t, `SELECT count(*) FROM effects WHERE message_id IN ('c-0', 'c-1')`) == 2 && e.committedLag(t) == 0
	})
	if err := c.stop(t); err != nil {
		t.Fatal(err)
	}
	if s := c.c.Stats(); s.CrashProbes != 0 {
		t.Errorf("C started %d partitions in probe after B's clean shutdown, want none", s.CrashProbes)
	}
	e.assertExactlyOnce(t, 1+1+2) // first-0, crash, c-*
	if n := e.count(t, `SELECT count(*) FROM partition_owners`); n != 0 {
		t.Errorf("%d partitions still marked as owned after C's clean shutdown", n)
	}
}

// A probe's mark on a record that finished counts for nothing, even when it
// finished dead-lettered, and the mark is gone once the probe ends. A
// dead-letters "bad" (its handler fails it permanently) and then dies
// holding both partitions. An operator redrives "bad"; B, probing, runs the
// redriven copy, dead-letters it again and dies (simulated) right after,
// before committing its offset, its mark still on the copy. With
// CrashLoopLimit 1 a death counted against the copy would make C
// dead-letter it a third time, as a crash loop; instead C skips it (its
// redrive grant is used up) and, its probe done, leaves no mark.
func TestFinishedProbeRecordsAreNeverBlamed(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	e.createDLQTopic(t)
	failBad := func(member string) consumer.Handler {
		return func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			if m.ID == "bad" {
				return dlq.Permanent(errors.New("bad is bad"))
			}
			return recordEffect(member)(ctx, tx, m)
		}
	}
	config := func(member string, h consumer.Handler) consumer.Config {
		cfg := e.config(member, h)
		cfg.CrashLoopLimit = 1
		return cfg
	}
	crashOn := func(value string) *testhook.Consumer {
		crash := func(rec *kgo.Record) error {
			if string(rec.Value) == value {
				return testhook.ErrCrash
			}
			return nil
		}
		return &testhook.Consumer{AfterCommit: crash, AfterDeadLetter: crash}
	}

	e.produce(t, []msg{{id: "bad", partition: 0}})
	a := e.start(testhook.WithConsumer(context.Background(), crashOn("crash-a")), config("a", failBad("a")))
	eventually(t, time.Minute, "A to dead-letter bad and commit past it", func() bool {
		return e.count(t, `SELECT count(*) FROM inbox WHERE message_id = 'bad' AND outcome = 'dead_lettered'`) == 1 &&
			e.committedOffset(t, 0) == 1
	})
	e.produce(t, []msg{{id: "crash-a", partition: 1}})
	if err := a.wait(t, time.Minute); !errors.Is(err, testhook.ErrCrash) {
		t.Fatalf("A's Run = %v, want the simulated crash", err)
	}
	e.redriveOnlyEntry(t)

	b := e.start(testhook.WithConsumer(context.Background(), crashOn("bad")), config("b", failBad("b")))
	if err := b.wait(t, time.Minute); !errors.Is(err, testhook.ErrCrash) {
		t.Fatalf("B's Run = %v, want the simulated crash after dead-lettering the redriven bad", err)
	}
	if s := b.c.Stats(); s.CrashProbes != 2 || s.DeadLettered != 1 {
		t.Fatalf("B: %d probes, %d dead letters; want both partitions in probe and the redriven bad dead-lettered", s.CrashProbes, s.DeadLettered)
	}
	if n := e.count(t, `SELECT count(*) FROM partition_owners WHERE running_offset IS NOT NULL AND running_id = 'bad'`); n != 1 {
		t.Fatalf("B's probe left no mark on the redriven bad: %s", e.ownerRows(t))
	}

	c := e.start(context.Background(), config("c", recordEffect("c")))
	e.produce(t, []msg{{id: "c-0", partition: 0}, {id: "c-1", partition: 1}})
	eventually(t, time.Minute, "C to catch up", func() bool {
		return e.count(t, `SELECT count(*) FROM effects WHERE message_id IN ('c-0', 'c-1')`) == 2 && e.committedLag(t) == 0
	})
	if s := c.c.Stats(); s.CrashProbes != 2 || s.CrashLoops != 0 || s.DeadLettered != 0 {
		t.Errorf("C: %d probes, %d crash loops, %d dead letters; want both partitions in probe and nothing dead-lettered",
			s.CrashProbes, s.CrashLoops, s.DeadLettered)
	}
	copies := 0
	for _, en := range e.dlqEntries(t) {
		if en.Err != nil || en.Info.Class == dlq.ClassCrashLoop {
			t.Errorf("dead letter %+v (err %v): bad finished each time, it never killed a process", en.Info, en.Err)
			continue
		}
		copies += en.Copies
	}
	if copies != 2 {
		t.Errorf("%d dead-letter copies of bad, want 2: A's and the redrive's", copies)
	}
	// Its probes passed the records there at its start: no mark is left
	// for a later death to count against.
	eventually(t, 30*time.Second, "C's probes to end and clear their marks", func() bool {
		return e.count(t, `SELECT count(*) FROM partition_owners WHERE running_offset IS NULL`) == 2
	})
	if err := c.stop(t); err != nil {
		t.Fatal(err)
	}
	e.assertExactlyOnce(t, 1+2) // crash-a, c-*
}

// A redriven record is dead-lettered in the inbox before it runs: a death
// while it runs counts against it all the same (its redrive grant is still
// there, unused), and a redrive that still kills the process is
// dead-lettered again, as a crash loop.
func TestCrashLoopOnRedriveIsDeadLettered(t *testing.T) {
	t.Parallel()
	const limit = 1
	e := newEnv(t, 1)
	e.createDLQTopic(t)
	e.produce(t, []msg{{id: "before", partition: 0}, {id: "poison", partition: 0}})
	a := e.start(context.Background(), e.config("a", func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.ID == "poison" {
			return dlq.Permanent(errors.New("poison is bad"))
		}
		return recordEffect("a")(ctx, tx, m)
	}))
	eventually(t, time.Minute, "A to dead-letter the poison and commit past it", func() bool {
		return e.count(t, `SELECT count(*) FROM inbox WHERE message_id = 'poison' AND outcome = 'dead_lettered'`) == 1 &&
			e.committedLag(t) == 0
	})
	if err := a.stop(t); err != nil {
		t.Fatal(err)
	}
	e.redriveOnlyEntry(t)
	e.produce(t, []msg{{id: "after", partition: 0}})

	deaths := e.restartUntilCaughtUp(t, "poison", limit, killInHandler, func() bool {
		return e.count(t, `SELECT count(*) FROM effects`) == 2 && e.committedLag(t) == 0
	})
	// The redrive is the partition's first unfinished record: probed alone
	// in every mode (a replay starts only at a record the inbox was asked
	// about), the second death counted against it.
	if deaths != limit+1 {
		t.Errorf("the worker died %d times on the redriven poison, want %d", deaths, limit+1)
	}
	var classes []dlq.Class
	for _, en := range e.dlqEntries(t) {
		if en.Err != nil {
			t.Fatalf("dead letter: %v", en.Err)
		}
		classes = append(classes, en.Info.Class)
	}
	if len(classes) != 2 || classes[1] != dlq.ClassCrashLoop {
		t.Errorf("dead-letter classes %v: want A's and then the redrive's as a crash loop", classes)
	}
	if n := e.count(t, `SELECT count(*) FROM redrive_grants`); n != 0 {
		t.Errorf("%d redrive grants left: the crash-loop dead letter must use it up", n)
	}
	e.assertExactlyOnce(t, 2) // before, after
}

// redriveOnlyEntry redrives the one entry of the dead-letter topic, as an
// operator does: a redrive grant, then the record back in its topic.
func (e *env) redriveOnlyEntry(t *testing.T) {
	t.Helper()
	entries := e.dlqEntries(t)
	if len(entries) != 1 {
		t.Fatalf("%d dead-letter entries, want 1", len(entries))
	}
	res, err := dlq.Redrive(context.Background(), e.kafka.Client(t), entries,
		dlq.RedriveOptions{Inbox: dedup.MustNew(e.db.Schema), DB: e.db.Pool})
	if err != nil || res[0].Action != dlq.Redriven {
		t.Fatalf("redrive = %+v, %v", res, err)
	}
}

// A clean shutdown whose deletion of its partition_owners rows fails (the
// database connection dies under it) tries again: a row left behind would
// make the next start count the clean exit as a death and probe. The
// deletion is held on a table lock until it waits, its connection is then
// terminated, and the lock released.
func TestCleanExitRetriesForgettingItsPartitions(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	a := e.start(context.Background(), e.config("a", recordEffect("a")))
	e.produce(t, []msg{{id: "m-0", partition: 0}})
	eventually(t, time.Minute, "A to process and commit its record", func() bool {
		return e.count(t, `SELECT count(*) FROM effects`) == 1 && e.committedLag(t) == 0
	})
	ctx := context.Background()
	lock, err := e.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lock.Rollback(ctx) }()
	if _, err := lock.Exec(ctx, `LOCK TABLE partition_owners IN EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	a.cancel()
	var pid int32
	eventually(t, time.Minute, "A's deletion of its rows to wait on the lock", func() bool {
		err := e.db.Pool.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'
			AND query LIKE 'DELETE FROM %' AND query LIKE '%' || $1 || '%partition_owners%'`, e.db.Schema).Scan(&pid)
		return err == nil
	})
	var terminated bool
	if err := e.db.Pool.QueryRow(ctx, `SELECT pg_terminate_backend($1)`, pid).Scan(&terminated); err != nil || !terminated {
		t.Fatalf("terminate the deletion's connection: %v, %v", terminated, err)
	}
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := a.wait(t, time.Minute); err != nil {
		t.Fatal(err)
	}
	if n := e.count(t, `SELECT count(*) FROM partition_owners`); n != 0 {
		t.Fatalf("%d partitions still marked as owned after A's clean shutdown: %s", n, e.ownerRows(t))
	}
	b := e.start(context.Background(), e.config("b", recordEffect("b")))
	e.produce(t, []msg{{id: "m-1", partition: 0}})
	eventually(t, time.Minute, "B to process its record", func() bool { return e.count(t, `SELECT count(*) FROM effects`) == 2 })
	if s := b.c.Stats(); s.CrashProbes != 0 {
		t.Errorf("B started %d partitions in probe after A's clean shutdown", s.CrashProbes)
	}
	if err := b.stop(t); err != nil {
		t.Fatal(err)
	}
	e.assertExactlyOnce(t, 2)
}

// A probe runs as many of the partition's unfinished records as its dead
// owner could have been running (partition_owners.in_flight: 1, BatchSize,
// or the buffer with key parallelism), not every record up to the
// partition's end: after a crash under load that was thousands of records
// one at a time. Records that had finished (in the inbox) go by without
// counting. A row of an owner that died before the column existed (NULL)
// is probed up to the end, as before.
func TestProbeRunsWhatTheDeadOwnerCouldHaveRun(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		inFlight any // the dead owner's partition_owners.in_flight
		finished int // records 0..finished-1 were processed before it died
		doneAt   int // the offset the probe ends at
	}{
		{"three in flight after five finished", 3, 5, 7},
		{"one in flight", 1, 0, 0},
		{"unknown", nil, 2, 19},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, 1)
			e.createDLQTopic(t)
			var msgs []msg
			for i := range 20 {
				msgs = append(msgs, msg{id: fmt.Sprint("r-", i), partition: 0, key: fmt.Sprint("k-", i%4)})
			}
			e.produce(t, msgs)
			ctx := context.Background()
			for i := range tc.finished {
				if _, err := e.db.Pool.Exec(ctx, `INSERT INTO inbox (consumer_group, message_id) VALUES ($1, $2)`, e.group, fmt.Sprint("r-", i)); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := e.db.Pool.Exec(ctx, `INSERT INTO partition_owners (consumer_group, topic, partition, owner, in_flight) VALUES ($1, $2, 0, 'dead', $3)`,
				e.group, e.topic, tc.inFlight); err != nil {
				t.Fatal(err)
			}
			logs := &lockedBuffer{}
			cfg := e.config("prober", recordEffect("prober"))
			cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
			m := e.start(ctx, cfg)
			eventually(t, time.Minute, "every unfinished record to be processed", func() bool {
				return e.count(t, `SELECT count(*) FROM effects`) == int64(20-tc.finished) && e.committedLag(t) == 0
			})
			if err := m.stop(t); err != nil {
				t.Fatal(err)
			}
			if s := m.c.Stats(); s.CrashProbes != 1 || s.Duplicates != int64(tc.finished) || s.Processed != int64(20-tc.finished) {
				t.Errorf("%d probes, %d duplicates, %d processed; want 1, %d, %d", s.CrashProbes, s.Duplicates, s.Processed, tc.finished, 20-tc.finished)
			}
			want := fmt.Sprintf(`msg="oncely partition probe done" topic=%s partition=0 offset=%d`, e.topic, tc.doneAt)
			if !strings.Contains(logs.String(), want) {
				t.Errorf("the probe did not end at offset %d; want %q in the log:\n%s", tc.doneAt, want, logs)
			}
			for i := range tc.finished {
				if n := e.count(t, `SELECT count(*) FROM effects WHERE message_id = $1`, fmt.Sprint("r-", i)); n != 0 {
					t.Errorf("r-%d, finished before the probe, ran again", i)
				}
			}
			if n := e.count(t, `SELECT count(*) FROM partition_owners`); n != 0 {
				t.Errorf("%d partitions still marked as owned after a clean shutdown: %s", n, e.ownerRows(t))
			}
		})
	}
}

// A probe passes the records that had finished before the owner died (most
// of those it meets: the dead owner finished them after its last offset
// commit) in bulk: one statement asks the inbox about the records buffered,
// and those it holds finished pass as duplicates, each with its span, with
// no mark and no transaction of their own. Only the records that had not
// finished, the suspect (a death was counted against it) and redrives are
// marked and run one at a time. Of 210 records the dead owner finished all
// but four; r-60, finished, is the suspect; r-120 is a redrive whose grant
// was used up (dead-lettered, finished). With a KeyFunc (user code, which
// may be what kills the process, works out each id) every record is
// marked and claimed, as before.
func TestProbePassesFinishedRecordsInBulk(t *testing.T) {
	t.Parallel()
	t.Run("header id", func(t *testing.T) { t.Parallel(); testProbePassesFinished(t, false) })
	t.Run("key func", func(t *testing.T) { t.Parallel(); testProbePassesFinished(t, true) })
}

func testProbePassesFinished(t *testing.T, keyFunc bool) {
	const total, suspect, redrive = 210, 60, 120
	unfinished := map[int64]bool{30: true, 90: true, 150: true, 209: true}
	e := newEnv(t, 1)
	e.createDLQTopic(t)
	ctx := context.Background()
	var recs []*kgo.Record
	for i := range total {
		var extra []kgo.RecordHeader
		if i == redrive {
			extra = append(extra, kgo.RecordHeader{Key: dlq.HeaderRedrive, Value: []byte(dlq.DefaultTopic(e.topic) + "/0/0")})
		}
		recs = append(recs, e.rec(0, fmt.Sprint("r-", i), fmt.Sprint("r-", i), extra...))
	}
	e.produceRecords(t, recs...)
	for i := range total {
		id := fmt.Sprint("r-", i)
		switch {
		case unfinished[int64(i)]:
			continue
		case i == redrive:
			if _, err := e.db.Pool.Exec(ctx, `INSERT INTO inbox (consumer_group, message_id, outcome) VALUES ($1, $2, 'dead_lettered')`, e.group, id); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if _, err := e.db.Pool.Exec(ctx, `WITH claim AS (INSERT INTO inbox (consumer_group, message_id) VALUES ($1, $2))
			INSERT INTO effects (message_id, partition, "offset", member) VALUES ($2, 0, $3, 'dead')`, e.group, id, i); err != nil {
			t.Fatal(err)
		}
	}
	// The owner died holding the partition, up to 10 records in flight; an
	// earlier death was counted against r-60, which finished since.
	if _, err := e.db.Pool.Exec(ctx, `INSERT INTO partition_owners (consumer_group, topic, partition, owner, in_flight, deaths, suspect_offset, suspect_kills)
		VALUES ($1, $2, 0, 'dead', 10, 2, $3, 1)`, e.group, e.topic, suspect); err != nil {
		t.Fatal(err)
	}

	stmts := &ownerStatements{}
	pool := e.tracedPool(t, stmts)
	tl := newTel(t)
	logs := &lockedBuffer{}
	cfg := e.config("prober", recordEffect("prober"))
	cfg.Pool, cfg.Logger = pool, slog.New(slog.NewTextHandler(logs, nil))
	cfg.TracerProvider, cfg.MeterProvider = tl.tp, tl.mp
	if keyFunc {
		cfg.KeyFunc = func(rec *kgo.Record) (string, error) { return string(rec.Value), nil }
	}
	m := e.start(ctx, cfg)
	want := fmt.Sprintf(`msg="oncely partition probe done" topic=%s partition=0 offset=%d`, e.topic, total-1)
	eventually(t, time.Minute, "the probe to end at the last record", func() bool { return strings.Contains(logs.String(), want) })
	// The probe ran past r-60, the suspect, which finished: its end forgets
	// it, so a later death is not counted as its second.
	if n := e.count(t, `SELECT count(*) FROM partition_owners WHERE suspect_offset IS NULL AND suspect_kills = 0 AND running_offset IS NULL`); n != 1 {
		t.Errorf("the probe's end left its row as %s; want no suspect and no mark", e.ownerRows(t))
	}
	eventually(t, time.Minute, "every record's offset to be committed", func() bool { return e.committedLag(t) == 0 })
	if err := m.stop(t); err != nil {
		t.Fatal(err)
	}

	e.assertExactlyOnce(t, total-1) // all but the redrive, dead-lettered
	if n := e.count(t, `SELECT count(*) FROM effects WHERE member = 'prober'`); n != int64(len(unfinished)) {
		t.Errorf("the probe ran %d handlers, want %d: the unfinished records", n, len(unfinished))
	}
	finished := int64(total - len(unfinished))
	if s := m.c.Stats(); s.CrashProbes != 1 || s.Processed != int64(len(unfinished)) || s.Duplicates != finished || s.CrashLoops != 0 || s.DeadLettered != 0 {
		t.Errorf("%d probes, %d processed, %d duplicates, %d crash loops, %d dead letters; want 1, %d, %d, 0, 0",
			s.CrashProbes, s.Processed, s.Duplicates, s.CrashLoops, s.DeadLettered, len(unfinished), finished)
	}
	if got := tl.sum(t, "oncely.consumer.duplicates"); got != finished {
		t.Errorf("duplicates metric = %d, want %d", got, finished)
	}
	spans := tl.ended("process " + e.topic)
	if len(spans) != total {
		t.Errorf("%d process spans, want one per record: %d", len(spans), total)
	}
	for _, s := range spans {
		a := attrs(s)
		off, outcome := a["messaging.kafka.offset"].AsInt64(), a["oncely.dedup.outcome"].AsString()
		if wantOutcome := map[bool]string{true: "new", false: "duplicate"}[unfinished[off]]; outcome != wantOutcome {
			t.Errorf("offset %d: span outcome %q, want %q", off, outcome, wantOutcome)
		}
	}

	// Marked, and claimed in a transaction each: the unfinished records,
	// the suspect and the redrive; no other. With a KeyFunc, every record.
	marked, claims := stmts.counts()
	wantMarked := []int64{30, suspect, 90, redrive, 150, 209}
	if keyFunc {
		wantMarked = wantMarked[:0]
		for i := range int64(total) {
			wantMarked = append(wantMarked, i)
		}
	}
	if !slices.Equal(marked, wantMarked) {
		t.Errorf("records marked in partition_owners: %v, want %v", marked, wantMarked)
	}
	if claims < len(wantMarked) || claims > len(wantMarked)+2 {
		t.Errorf("%d transactions claimed inbox ids, want %d: one per record marked (and a couple of retries at most)", claims, len(wantMarked))
	}
	if n := e.count(t, `SELECT count(*) FROM partition_owners`); n != 0 {
		t.Errorf("%d partitions still marked as owned after a clean shutdown: %s", n, e.ownerRows(t))
	}
}

// tracedPool is a pool on the env's schema whose statements stmts sees.
func (e *env) tracedPool(t *testing.T, stmts *ownerStatements) *pgxpool.Pool {
	t.Helper()
	pcfg, err := pgxpool.ParseConfig(e.db.URL)
	if err != nil {
		t.Fatal(err)
	}
	pcfg.ConnConfig.RuntimeParams["search_path"] = e.db.Schema
	pcfg.ConnConfig.Tracer = stmts
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close) // after the consumer's cleanup
	return pool
}

// In batch mode, a probe runs the batch its dead owner could have been
// running (in_flight records from the first that had not finished) again,
// as one batch: no record is marked, and a transaction or two claim the
// ten records, where a probe one record at a time marks each and claims
// each in its own transaction. With key parallelism the window runs on the
// lanes, unmarked, and the replay ends once its records finished. Only a
// death the dead owner may owe to a record (it was itself probing, or
// replaying) makes the probe strict. Records 0..19 of 40 finished before
// the owner died, up to 10 in flight.
func TestProbeReplaysTheDeadOwnersBatch(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		lanes   int    // KeyParallelism; 0: batch mode
		died    string // the dead owner's row, beyond in_flight
		strict  bool
		keyFunc bool // a KeyFunc: the inbox cannot be asked which records finished
	}{
		{"died in a batch", 0, "", false, false},
		{"died replaying", 0, "replay_end = 29", true, false},
		{"died probing", 0, "running_offset = 25, running_id = 'r-25'", true, false},
		{"died before its probe marked a record", 0, "replay_end = -1", true, false},
		{"a KeyFunc", 0, "", true, true},
		{"key parallelism, died running", 4, "", false, false},
		{"key parallelism, died replaying", 4, "replay_end = 29", true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			const total, finished, inFlight = 40, 20, 10
			e := newEnv(t, 1)
			e.createDLQTopic(t)
			ctx := context.Background()
			var msgs []msg
			for i := range total {
				msgs = append(msgs, msg{id: fmt.Sprint("r-", i), partition: 0, key: fmt.Sprint("k-", i%4)})
			}
			e.produce(t, msgs)
			for i := range finished {
				if _, err := e.db.Pool.Exec(ctx, `WITH claim AS (INSERT INTO inbox (consumer_group, message_id) VALUES ($1, $2))
					INSERT INTO effects (message_id, partition, "offset", member) VALUES ($2, 0, $3, 'dead')`, e.group, fmt.Sprint("r-", i), i); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := e.db.Pool.Exec(ctx, `INSERT INTO partition_owners (consumer_group, topic, partition, owner, in_flight) VALUES ($1, $2, 0, 'dead', $3)`,
				e.group, e.topic, inFlight); err != nil {
				t.Fatal(err)
			}
			if tc.died != "" {
				if _, err := e.db.Pool.Exec(ctx, `UPDATE partition_owners SET `+tc.died); err != nil {
					t.Fatal(err)
				}
			}
			stmts := &ownerStatements{}
			logs := &lockedBuffer{}
			cfg := e.config("prober", recordEffect("prober"))
			cfg.BatchSize, cfg.KeyParallelism = inFlight, tc.lanes
			if tc.lanes > 0 {
				cfg.BatchSize = 0
			}
			if tc.keyFunc {
				cfg.KeyFunc = func(rec *kgo.Record) (string, error) { return string(rec.Value), nil }
			}
			cfg.Pool, cfg.Logger = e.tracedPool(t, stmts), slog.New(slog.NewTextHandler(logs, nil))
			m := e.start(ctx, cfg)
			eventually(t, time.Minute, "every record to be processed and committed", func() bool {
				return e.count(t, `SELECT count(*) FROM effects`) == total && e.committedLag(t) == 0
			})
			if err := m.stop(t); err != nil {
				t.Fatal(err)
			}
			e.assertExactlyOnce(t, total)

			last := finished + inFlight - 1
			done := fmt.Sprintf(`msg="oncely partition probe done" topic=%s partition=0 offset=%d`, e.topic, last)
			marked, claims := stmts.counts()
			if tc.strict {
				var want []int64
				from := finished
				if tc.keyFunc {
					from = 0 // every record is marked before its KeyFunc runs
				}
				for i := from; i <= last; i++ {
					want = append(want, int64(i))
				}
				if !slices.Equal(marked, want) {
					t.Errorf("records marked: %v, want each of the dead owner's batch: %v", marked, want)
				}
				if !strings.Contains(logs.String(), done+"\n") {
					t.Errorf("want the probe to end at offset %d, one record at a time: %q in the log:\n%s", last, done, logs)
				}
				if claims < inFlight {
					t.Errorf("%d transactions claimed inbox ids, want at least %d: one per record probed", claims, inFlight)
				}
			} else {
				if len(marked) != 0 {
					t.Errorf("records marked: %v, want none: the batch runs again as one", marked)
				}
				if want := fmt.Sprintf("%s replayed=%d", done, inFlight); !strings.Contains(logs.String(), want) {
					t.Errorf("want the probe to replay %d records up to offset %d: %q in the log:\n%s", inFlight, last, want, logs)
				}
				// The replay's batch, and the ten records after it in a
				// batch or two: a handful, where a strict probe takes ten
				// for the replayed records alone. Key parallelism claims
				// each record in a transaction of its own either way.
				if claims > 4 && tc.lanes == 0 {
					t.Errorf("%d transactions claimed inbox ids, want at most 4: the replay is one batch", claims)
				}
			}
			if s := m.c.Stats(); s.CrashProbes != 1 || s.Processed != total-finished || s.CrashLoops != 0 || s.DeadLettered != 0 {
				t.Errorf("%d probes, %d processed, %d crash loops, %d dead letters; want 1, %d, 0, 0",
					s.CrashProbes, s.Processed, s.CrashLoops, s.DeadLettered, total-finished)
			}
			if n := e.count(t, `SELECT count(*) FROM partition_owners`); n != 0 {
				t.Errorf("%d partitions still marked as owned after a clean shutdown: %s", n, e.ownerRows(t))
			}
		})
	}
}

// ownerStatements counts, through pgx's tracer, the records a consumer
// marks in partition_owners (by offset, in order) and the transactions it
// begins with an inbox claim.
type ownerStatements struct {
	mu     sync.Mutex
	marked []int64
	claims int
}

func (s *ownerStatements) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	// A mark sets running_offset; with a KeyFunc a second statement adds
	// the id (SET running_id), which is not a second mark.
	// The end of a probe clears the mark (and the replay's): not a mark.
	if !strings.HasPrefix(strings.TrimSpace(d.SQL), "UPDATE") || !strings.Contains(d.SQL, "partition_owners") ||
		!strings.Contains(d.SQL, "SET running_offset") || strings.Contains(d.SQL, "replay_end") || len(d.Args) < 5 {
		return ctx
	}
	var off *int64
	switch v := d.Args[4].(type) {
	case int64:
		off = &v
	case *int64:
		off = v
	}
	if off != nil { // nil: the probe's end clears the mark
		s.mu.Lock()
		s.marked = append(s.marked, *off)
		s.mu.Unlock()
	}
	return ctx
}

func (s *ownerStatements) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (s *ownerStatements) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	for _, q := range d.Batch.QueuedQueries {
		if strings.Contains(q.SQL, "INSERT INTO") && strings.Contains(q.SQL, `"inbox"`) {
			s.mu.Lock()
			s.claims++
			s.mu.Unlock()
			break
		}
	}
	return ctx
}

func (s *ownerStatements) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (s *ownerStatements) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

func (s *ownerStatements) counts() (marked []int64, claims int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.marked), s.claims
}
