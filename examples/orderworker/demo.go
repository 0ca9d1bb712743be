package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

// demoConfig configures the demo.
type demoConfig struct {
	DatabaseURL string
	Schema      string // dropped and recreated: the demo starts from empty tables
	Spec        orderSpec
	WorkerExe   string    // binary run as `WorkerExe run --brokers ...`
	WorkerLog   io.Writer // the workers' logs
}

const (
	demoTopic       = "orders"
	demoEventsTopic = "order-events"
	demoGroup       = "orderworker"
	demoInstanceID  = "demo-worker"
)

// demoCmd runs the demo and prints its report to stdout.
func demoCmd(args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("orderworker demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg := demoConfig{}
	fs.StringVar(&cfg.DatabaseURL, "database-url", envOr(getenv, "DATABASE_URL", defaultDatabaseURL), "Postgres URL (env DATABASE_URL)")
	fs.StringVar(&cfg.Schema, "schema", "orderworker_demo", "schema for the demo's tables; DROPPED at start")
	fs.IntVar(&cfg.Spec.Count, "orders", 3000, "orders to produce")
	fs.IntVar(&cfg.Spec.Customers, "customers", 50, "customers the orders are spread over")
	fs.Float64Var(&cfg.Spec.DupRate, "dup-rate", 0.2, "fraction of orders delivered twice")
	logFile := fs.String("log-file", filepath.Join(os.TempDir(), "orderworker-demo.log"), "file for the workers' logs")
	if err := parse(fs, args); err != nil {
		return usageExit(stderr, err)
	}
	if _, err := pgxpool.ParseConfig(cfg.DatabaseURL); err != nil {
		return usageExit(stderr, invalidFlag("--database-url (DATABASE_URL)", err))
	}
	if err := validateSchema(cfg.Schema); err != nil {
		return usageExit(stderr, invalidFlag("--schema", err))
	}
	if name, err := cfg.Spec.validate(); err != nil {
		if name == "--count" {
			name = "--orders" // the demo's name for it
		}
		return usageExit(stderr, invalidFlag(name, err))
	}

	exe, err := os.Executable()
	if err != nil {
		printf(stderr, "orderworker demo: find own binary: %v\n", err)
		return exitError
	}
	cfg.WorkerExe = exe
	f, err := os.Create(*logFile)
	if err != nil {
		return usageExit(stderr, invalidFlag("--log-file", err))
	}
	defer func() { _ = f.Close() }() // the workers wrote their last line before they exited
	cfg.WorkerLog = f
	printf(stderr, "demo: worker logs go to %s\n", *logFile)

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	rep, err := runDemo(ctx, cfg, stderr)
	if rep != nil {
		printf(stdout, "\n")
		rep.print(stdout)
	}
	switch {
	case err != nil:
		printf(stderr, "orderworker demo: %v (worker logs: %s)\n", err, *logFile)
		return exitError
	case !rep.ok():
		printf(stderr, "orderworker demo: FAILED: some order did not count, or was not announced, exactly once (worker logs: %s)\n", *logFile)
		return exitError
	}
	printf(stdout, "\nevery order counted exactly once, and was announced by exactly one order.accepted event.\n")
	return exitOK
}

// runDemo is the README's main job, step by step: produce orders with
// duplicates, start a worker, SIGKILL it mid-stream (after some of its
// transactions committed and before their offsets did), start another, and
// check that every order has exactly one effect and that exactly one
// order.accepted event per order reached Kafka.
func runDemo(ctx context.Context, cfg demoConfig, progress io.Writer) (*report, error) {
	start := time.Now()
	say := func(format string, args ...any) {
		printf(progress, "demo: %5.1fs  %s\n", time.Since(start).Seconds(), fmt.Sprintf(format, args...))
	}

	pool, err := pgxpool.New(ctx, cfg.DatabaseURL)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{cfg.Schema}.Sanitize()+` CASCADE`); err != nil {
		return nil, fmt.Errorf("reset schema %s: %w", cfg.Schema, err)
	}
	// The same start-up step every worker runs; doing it here first lets the
	// demo count rows from the start.
	st, err := newStore(cfg.Schema, demoEventsTopic)
	if err != nil {
		return nil, err
	}
	if err := st.migrate(ctx, pool, slog.New(slog.DiscardHandler)); err != nil {
		return nil, err
	}

	cluster, err := startKfake(demoTopic, demoEventsTopic)
	if err != nil {
		return nil, err
	}
	defer cluster.Close()
	brokers := cluster.ListenAddrs()
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)

	batch := generate(cfg.Spec, newRand())
	if err := produce(ctx, cl, demoTopic, batch.Deliveries, 0); err != nil {
		return nil, err
	}
	say("produced %d records to in-process Kafka at %s: %d orders, %d of them delivered twice",
		len(batch.Deliveries), brokers[0], len(batch.Orders), batch.Duplicates)

	args := []string{"run",
		"--brokers", brokers[0], "--topic", demoTopic, "--events-topic", demoEventsTopic, "--group", demoGroup,
		"--schema", cfg.Schema,
		"--http-addr", "127.0.0.1:0",
		// Static membership: the restarted worker takes its partitions back
		// at once instead of waiting for the dead one's session to expire.
		"--instance-id", demoInstanceID, "--session-timeout", "3s",
	}
	env := []string{"DATABASE_URL=" + cfg.DatabaseURL}
	q := newEffectQueries(cfg.Schema)

	// 1. A worker runs until about a third of the orders have effects...
	w1, err := startWorkerProcess(ctx, cfg.WorkerExe, args, env, "worker-1", cfg.WorkerLog)
	if err != nil {
		return nil, err
	}
	defer w1.kill()
	say("started worker-1 (pid %d)", w1.cmd.Process.Pid)
	third := int64(len(batch.Orders) / 3)
	if err := poll(ctx, 30*time.Second, 5*time.Millisecond, "a third of the effects", func(ctx context.Context) (bool, error) {
		if w1.exited() {
			return false, giveUp(errors.New("worker-1 exited early"))
		}
		n, err := queryInt(ctx, pool, q.count)
		return n >= third, err
	}); err != nil {
		return nil, err
	}

	// 2. ...and dies without warning: no drain, no final offset commit, no
	// leave-group. The effects it committed since its last offset commit
	// will be delivered again to its successor.
	w1.kill()
	effects, _ := queryInt(ctx, pool, q.count)
	committed := committedRecords(ctx, adm, demoGroup, demoTopic)
	say("killed worker-1 with SIGKILL: %d orders had effects; Kafka's committed offsets covered %d records",
		effects, committed)

	// 3. A new worker with the same instance id takes over and finishes.
	w2, err := startWorkerProcess(ctx, cfg.WorkerExe, args, env, "worker-2", cfg.WorkerLog)
	if err != nil {
		return nil, err
	}
	defer w2.kill()
	say("started worker-2 (pid %d)", w2.cmd.Process.Pid)
	if err := poll(ctx, 40*time.Second, 20*time.Millisecond, "every order's effect and offsets committed to the end",
		func(ctx context.Context) (bool, error) {
			if w2.exited() {
				return false, giveUp(errors.New("worker-2 exited early"))
			}
			n, err := queryInt(ctx, pool, q.countDistinct)
			if err != nil || n < int64(len(batch.Orders)) {
				return false, err
			}
			return offsetsCaughtUp(ctx, adm, demoGroup, demoTopic)
		}); err != nil {
		return nil, err
	}
	say("all %d orders have an effect and the group's offsets reached the end of every partition", len(batch.Orders))
	// Every effect's transaction also enqueued its event: wait until the
	// relay published them all.
	if err := poll(ctx, 20*time.Second, 20*time.Millisecond, "the relay to publish every event",
		func(ctx context.Context) (bool, error) {
			if w2.exited() {
				return false, giveUp(errors.New("worker-2 exited early"))
			}
			n, err := queryInt(ctx, pool, q.pending)
			return n == 0, err
		}); err != nil {
		return nil, err
	}
	say("the outbox is empty: the relays published every order.accepted event to %s", demoEventsTopic)

	// 4. A graceful stop: SIGTERM, drain, commit, leave, exit 0.
	exit, err := w2.terminate(10 * time.Second)
	if err != nil {
		return nil, err
	}
	say("stopped worker-2 with SIGTERM: exit status %d", exit)

	rep, err := checkEffects(ctx, pool, cfg.Schema, demoGroup, batch)
	if err != nil {
		return nil, err
	}
	if err := checkEvents(ctx, brokers, demoEventsTopic, batch, rep); err != nil {
		return nil, err
	}
	rep.Crashes = 1
	rep.LastExit = exit
	if m := w2.find(stoppedRE); m != nil {
		rep.Absorbed, _ = strconv.ParseInt(m[2], 10, 64)
	}
	return rep, nil
}

// committedRecords sums the group's committed offsets over topic's
// partitions: how many records Kafka considers done (-1 if unknown).
func committedRecords(ctx context.Context, adm *kadm.Client, group, topic string) int64 {
	offs, err := adm.FetchOffsetsForTopics(ctx, group, topic)
	if err != nil {
		return -1
	}
	var sum int64
	for _, o := range offs[topic] {
		if o.Err == nil && o.At > 0 {
			sum += o.At
		}
	}
	return sum
}
