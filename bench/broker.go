package main

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/internal/sqlident"
	"github.com/oncely/oncely/migrations"
)

// The broker benchmarks (nats, rabbit) run modePerRecord, modeBatch and
// modeBatchRecs with the broker's oncely consumer, beside modeHand.
const (
	modeHand      = "hand"       // a hand-written consumer of the broker; per message: BEGIN, inbox insert, effect, COMMIT, ack
	benchGroup    = "bench"      // the inbox's consumer group (and the NATS durable's name)
	benchIDHeader = "message-id" // each message's id
)

var brokerModes = []string{modeHand, modePerRecord, modeBatch, modeBatchRecs}

// brokerOptions are the flags that every broker benchmark takes.
type brokerOptions struct {
	dbURL       string
	n, batchN   int
	rounds      int
	concurrency int
	batchSize   int
	timeout     time.Duration
	modes       string
	cpuProfile  string
}

// register defines the flags on fs; pkg names the oncely consumer package.
func (o *brokerOptions) register(fs *flag.FlagSet, pkg string) {
	fs.StringVar(&o.dbURL, "database-url", cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "Postgres to measure against (a fresh schema, dropped afterwards)")
	fs.IntVar(&o.n, "n", 10_000, "messages per round of the hand-written and per-message modes")
	fs.IntVar(&o.batchN, "batch-n", 50_000, "messages per round of the batch modes (a run long enough that the start-up's round trips do not count)")
	fs.IntVar(&o.rounds, "rounds", 5, "rounds; the table shows medians, the targets the median of each round's ratio")
	fs.IntVar(&o.concurrency, "concurrency", 4, "transactions in flight, in every mode (goroutines of the hand-written consumer; Config.Concurrency of "+pkg+") and the pool's size")
	fs.IntVar(&o.batchSize, "batch-size", 200, pkg+" Config.BatchSize of batch mode")
	fs.DurationVar(&o.timeout, "timeout", 5*time.Minute, "limit for one mode in one round")
	fs.StringVar(&o.modes, "modes", strings.Join(brokerModes, ","), "modes to run, comma-separated (the ratios need all four)")
	fs.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of the whole run to this file")
}

// start checks the options and starts the CPU profile, if asked for;
// stop ends it. modes are the modes to run.
func (o *brokerOptions) start(command string) (modes []string, stop func(), err error) {
	if o.n <= 0 || o.batchN <= 0 || o.rounds <= 0 || o.concurrency <= 0 || o.batchSize <= 1 {
		return nil, nil, fmt.Errorf("%s: -n, -batch-n, -rounds and -concurrency must be positive, -batch-size above 1", command)
	}
	modes = strings.Split(o.modes, ",")
	for _, m := range modes {
		if !slices.Contains(brokerModes, m) {
			return nil, nil, fmt.Errorf("%s: unknown mode %q (%s)", command, m, brokerModes)
		}
	}
	stop, err = startCPUProfile(o.cpuProfile)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: cpu profile: %w", command, err)
	}
	return modes, stop, nil
}

// label is mode's name in the report; hand names the hand-written
// consumer's settings.
func (o *brokerOptions) label(mode, hand string) string {
	switch mode {
	case modeHand:
		return "hand-written (" + hand + ")"
	case modePerRecord:
		return "oncely per-message"
	case modeBatch:
		return fmt.Sprintf("oncely batch %d, BatchHandler", o.batchSize)
	}
	return fmt.Sprintf("oncely batch %d, Handler per message", o.batchSize)
}

// brokerRound is one mode's result in one round.
type brokerRound struct {
	rate    float64       // messages/s
	elapsed time.Duration // from the consumer's start to the last message's commit
	cpu     time.Duration // this process's CPU time per message
}

// brokerBench runs a broker benchmark's rounds: each round runs every mode
// on a fresh queue (or stream) of its own messages, in an order that
// rotates from round to round, and checks that each message took effect
// once; then it reports every round, the medians and the targets.
type brokerBench struct {
	n, batchN, rounds int
	modes             []string // the modes to run; the ratios need all of brokerModes
	pool              *pgxpool.Pool
	label             func(mode string) string
	// run publishes n messages to a fresh queue, consumes them with mode
	// and removes the queue.
	run func(ctx context.Context, mode string, n int) (brokerRound, error)
}

// messages is how many messages a round of mode consumes.
func (b *brokerBench) messages(mode string) int {
	if mode == modeBatch || mode == modeBatchRecs {
		return b.batchN
	}
	return b.n
}

func (b *brokerBench) runRounds(ctx context.Context) error {
	results := map[string][]brokerRound{}
	var perRecordRatios, batchRatios, batchRecsRatios []float64
	all := len(b.modes) == len(brokerModes)
	for round := range b.rounds {
		order := append(slices.Clone(b.modes[round%len(b.modes):]), b.modes[:round%len(b.modes)]...)
		for _, m := range order {
			if _, err := b.pool.Exec(ctx, `TRUNCATE effects, inbox`); err != nil {
				return err
			}
			n := b.messages(m)
			res, err := b.run(ctx, m, n)
			if err != nil {
				return fmt.Errorf("round %d, %s: %w", round+1, m, err)
			}
			var effects int64
			if err := b.pool.QueryRow(ctx, `SELECT count(*) FROM effects`).Scan(&effects); err != nil {
				return err
			}
			if effects != int64(n) {
				return fmt.Errorf("round %d, %s: %d effects for %d messages", round+1, m, effects, n)
			}
			results[m] = append(results[m], res)
		}
		if !all {
			for _, m := range b.modes {
				fmt.Printf("round %d: %s %.0f msg/s, CPU %s/msg\n", round+1, b.label(m), results[m][round].rate, results[m][round].cpu)
			}
			continue
		}
		hand := results[modeHand][round].rate
		pr, bh, br := results[modePerRecord][round].rate/hand, results[modeBatch][round].rate/hand, results[modeBatchRecs][round].rate/hand
		perRecordRatios, batchRatios, batchRecsRatios = append(perRecordRatios, pr), append(batchRatios, bh), append(batchRecsRatios, br)
		fmt.Printf("round %d:", round+1)
		for _, m := range brokerModes {
			r := results[m][round]
			fmt.Printf(" %s %.0f msg/s (%.2f×, CPU %s/msg);", m, r.rate, r.rate/hand, r.cpu.Round(100*time.Nanosecond))
		}
		fmt.Println()
	}
	if !all {
		return nil
	}
	fmt.Printf("\n%-40s %9s %12s %12s\n", "mode", "messages", "msg/s", "CPU/msg")
	for _, m := range brokerModes {
		rates, cpus := make([]float64, len(results[m])), make([]float64, len(results[m]))
		for i, r := range results[m] {
			rates[i], cpus[i] = r.rate, float64(r.cpu)
		}
		fmt.Printf("%-40s %9d %12.0f %12s\n", b.label(m), b.messages(m), median(rates), time.Duration(median(cpus)).Round(100*time.Nanosecond))
	}
	fmt.Println("(msg/s and CPU/msg, this process's: the medians of the rounds)")
	verdict := func(ok bool) string {
		if ok {
			return "met"
		}
		return "NOT met"
	}
	pr, bh, br := median(perRecordRatios), median(batchRatios), median(batchRecsRatios)
	fmt.Printf("\ntargets (median of the rounds' ratios to the hand-written consumer of the same round):\n")
	fmt.Printf("  oncely per-message                ≥ 1× hand: %.2f× %.2f (%s)\n", pr, perRecordRatios, verdict(pr >= 1))
	fmt.Printf("  oncely batch, BatchHandler        ≥ 5× hand: %.2f× %.2f (%s)\n", bh, batchRatios, verdict(bh >= 5))
	fmt.Printf("  oncely batch, Handler per message ≥ 5× hand: %.2f× %.2f (%s)\n", br, batchRecsRatios, verdict(br >= 5))
	return nil
}

// brokerDB creates a fresh schema named after prefix, migrated, with the
// effects table, and a pool of conns connections whose search_path is it;
// drop drops the schema and closes the pool.
func brokerDB(ctx context.Context, dbURL, prefix string, conns int) (pool *pgxpool.Pool, schema string, drop func(), err error) {
	schema = uniqueName(prefix)
	pcfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		return nil, "", nil, err
	}
	pcfg.ConnConfig.RuntimeParams["search_path"] = schema
	pcfg.MaxConns, pcfg.MinConns = int32(conns), int32(conns)
	pool, err = pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, "", nil, err
	}
	drop = func() {
		_, _ = pool.Exec(context.WithoutCancel(ctx), "DROP SCHEMA "+sqlident.Quote(schema)+" CASCADE")
		pool.Close()
	}
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+sqlident.Quote(schema)); err != nil {
		pool.Close()
		return nil, "", nil, fmt.Errorf("create schema: %w", err)
	}
	mig, err := migrations.New(pool, migrations.Config{Schema: schema})
	if err == nil {
		_, err = mig.Up(ctx)
	}
	if err == nil {
		_, err = pool.Exec(ctx, `CREATE TABLE effects (message_id text NOT NULL, seq bigint NOT NULL)`)
	}
	if err != nil {
		drop()
		return nil, "", nil, fmt.Errorf("migrate: %w", err)
	}
	return pool, schema, drop, nil
}

// benchEffect is the oncely modes' Handler: the message's effect, one row.
func benchEffect(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
	_, err := tx.Exec(ctx, `INSERT INTO effects (message_id, seq) VALUES ($1, $2)`, msg.ID, msg.Offset)
	return err
}

// benchBatchEffect is the BatchHandler of batch mode: the same rows, written
// by one multi-row insert.
func benchBatchEffect(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
	ids, seqs := make([]string, len(msgs)), make([]int64, len(msgs))
	for i, msg := range msgs {
		ids[i], seqs[i] = msg.ID, msg.Offset
	}
	_, err := tx.Exec(ctx, `INSERT INTO effects (message_id, seq) SELECT * FROM unnest($1::text[], $2::bigint[])`, ids, seqs)
	return err
}

// handEffect is the hand-written consumers' transaction for one message:
// INSERT into oncely's inbox table (as a user who migrated oncely's schema
// would) ON CONFLICT DO NOTHING, and the effect only for a new id.
func handEffect(ctx context.Context, pool *pgxpool.Pool, id, topic string, seq int64) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, `INSERT INTO inbox (consumer_group, message_id, topic, "offset") VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING`,
			benchGroup, id, topic, seq)
		if err != nil || tag.RowsAffected() == 0 {
			return err // a duplicate: nothing more to do
		}
		_, err = tx.Exec(ctx, `INSERT INTO effects (message_id, seq) VALUES ($1, $2)`, id, seq)
		return err
	})
}

// timeMode starts a consumer with begin, which returns its count of
// messages processed and its Run, and times it until that count reaches n;
// then it stops the consumer. It fails when Run returns first, or timeout
// passes.
func timeMode(ctx context.Context, timeout time.Duration, n int,
	begin func() (done func() int64, run func(context.Context) error, err error)) (brokerRound, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	start, cpu0 := time.Now(), selfCPU()
	done, run, err := begin()
	if err != nil {
		return brokerRound{}, err
	}
	errc := make(chan error, 1)
	go func() { errc <- run(runCtx) }()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for done() < int64(n) {
		select {
		case err := <-errc:
			return brokerRound{}, fmt.Errorf("stopped after %d messages: %w", done(), err)
		case <-ctx.Done():
			return brokerRound{}, fmt.Errorf("%d of %d messages in %s", done(), n, timeout)
		case <-tick.C:
		}
	}
	elapsed, cpu := time.Since(start), selfCPU()-cpu0
	stop()
	if err := <-errc; err != nil {
		return brokerRound{}, err
	}
	return brokerRound{rate: float64(n) / elapsed.Seconds(), elapsed: elapsed, cpu: cpu / time.Duration(n)}, nil
}

// runWorkers runs work in n goroutines until each returns, and returns the
// first error of one of them, if any.
func runWorkers(n int, work func() error) error {
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for range n {
		wg.Go(func() {
			if err := work(); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	return <-errs // nil when none failed
}
