// Command bench measures oncely's consumer against a raw-SQL ceiling, a naive
// at-least-once consumer and Watermill, in one run against an in-process
// kfake broker (a child process of this one) and a real Postgres, and prints
// records/s, end-to-end latency, the ratios between the modes and whether
// the project's targets hold. docs/BENCHMARKS.md says how to read it.
//
//	cd bench && go run . [flags]      (or: make bench)
//
// `go run . idempotency [flags]` measures the Idempotency-Key middleware
// instead: its Postgres and Redis stores against a hand-written Redis
// SET NX + GET version (make bench-idempotency). `go run . nats [flags]`
// measures the NATS JetStream consumer, per message and in batch mode,
// against a hand-written JetStream consumer (make bench-nats); `go run .
// rabbit [flags]` the RabbitMQ consumer against a hand-written amqp091-go
// consumer (make bench-rabbit).
package main

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/bench/internal/kfakechild"
	"github.com/oncely/oncely/bench/internal/runenv"
)

type options struct {
	fetchMaxWait time.Duration
	dbURL        string
	modes        string
	n            int
	batchN       int
	batchRecsN   int
	partitions   int
	keys         int
	conns        int

	latencyRecords int
	latencyRate    float64

	batchSize int

	keyN, keySeqN  int
	keyParallelism int
	keySleep       time.Duration
	keyLatencyRate float64

	rssN int

	effect string

	workload  string
	contended contendedOptions
	given     map[string]bool // flags set on the command line

	rounds      int
	compression string
	timeout     time.Duration
	cpuProfile  string
	progress    bool
}

// keyLatencyRecords is the size of the per-key modes' latency phase: four
// seconds' worth.
func (o options) keyLatencyRecords() int { return int(4 * o.keyLatencyRate) }

// The modes, in the order they run.
const (
	modeCeiling   = "ceiling"
	modeNaive     = "naive"
	modeNaiveIn   = "naive-inbox"
	modePerRecord = "oncely"
	modeBatch     = "batch"
	modeBatchRecs = "batch-records"
	modeWatermill = "watermill"
	modeKeySeq    = "perkey-seq"
	modeKeyPar    = "perkey-par"
	modeRSS       = "rss"
)

var allModes = []string{modeCeiling, modeNaive, modeNaiveIn, modePerRecord, modeBatch, modeBatchRecs, modeWatermill, modeKeySeq, modeKeyPar, modeRSS}

func main() {
	// The broker's record storage (a 1M-record backlog) lives in a child
	// process, so that this one's RSS is the consumers' own.
	if len(os.Args) == 2 && os.Args[1] == kfakechild.Arg {
		if err := kfakechild.Serve(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		return
	}
	if len(os.Args) >= 2 && os.Args[1] == rabbitCommand {
		if err := runRabbit(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		return
	}
	if len(os.Args) >= 2 && os.Args[1] == natsCommand {
		if err := runNATS(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		return
	}
	if len(os.Args) >= 2 && os.Args[1] == idemCommand {
		if err := runIdempotency(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		return
	}
	var o options
	flag.StringVar(&o.dbURL, "database-url", cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "Postgres to measure against (each mode gets a fresh schema, dropped afterwards)")
	flag.StringVar(&o.modes, "modes", strings.Join(allModes, ","), "modes to run, comma-separated: "+strings.Join(allModes, ","))
	flag.IntVar(&o.n, "n", 10_000, "backlog records for the per-record modes (naive, oncely, watermill)")
	flag.IntVar(&o.batchN, "batch-n", 100_000, "records for the raw-SQL ceiling and batch mode")
	flag.IntVar(&o.batchRecsN, "batch-records-n", 40_000, "records for batch mode with a per-record Handler")
	flag.IntVar(&o.partitions, "partitions", 4, "partitions of the throughput modes' topics")
	flag.IntVar(&o.keys, "keys", 1000, "distinct record keys in the throughput modes")
	flag.IntVar(&o.conns, "conns", 4, "Postgres connections of the throughput modes (and of the ceiling)")
	flag.IntVar(&o.latencyRecords, "latency-records", 1000, "records produced at -latency-rate after the backlog drained; their latencies are p50/p99")
	flag.Float64Var(&o.latencyRate, "latency-rate", 500, "records/s of the latency phase")
	flag.DurationVar(&o.fetchMaxWait, "fetch-max-wait", 0, "consumer.Config.FetchMaxWait of the oncely modes (0: its default)")
	flag.IntVar(&o.batchSize, "batch-size", 500, "consumer.Config.BatchSize of batch mode")
	flag.IntVar(&o.keyN, "key-n", 5000, "records of the per-key parallel mode (one partition, 100 keys)")
	flag.IntVar(&o.keySeqN, "key-seq-n", 500, "records of the per-partition sequential mode it is compared with")
	flag.IntVar(&o.keyParallelism, "key-parallelism", 64, "consumer.Config.KeyParallelism of the per-key parallel mode, and the per-key modes' pool size (lowered, with a warning, when the server has not that many connections free)")
	flag.DurationVar(&o.keySleep, "key-sleep", 5*time.Millisecond, "handler sleep inside the transaction in the per-key modes")
	flag.Float64Var(&o.keyLatencyRate, "key-latency-rate", 50, "records/s of the per-key modes' latency phase")
	flag.IntVar(&o.rssN, "rss-n", 1_000_000, "backlog records of the RSS mode (batch mode)")
	flag.StringVar(&o.compression, "compression", "none", "codec the records are produced with (none, snappy, lz4, zstd, gzip); consumers pay its decompression")
	flag.StringVar(&o.effect, "effect", effectRow, "what a record's handler writes: "+effectRow+" (one row in a table without indexes, the cheapest write there is) or "+effectOrder+" (as the orderworker example: an order row with a primary key, and an upsert of its key's balance)")
	flag.IntVar(&o.rounds, "rounds", 5, "rounds of every mode but rss; the table shows medians, the targets the median of each round's ratio (-workload contended: default 3)")
	flag.StringVar(&o.workload, "workload", workloadUncontended, "records and effects: "+workloadUncontended+" (each key on one partition, -effect) or "+workloadContended+
		" (orders keyed by order id over -contended-partitions, -customers customers, the orderworker example's effects; -modes then picks from "+strings.Join(allContendedModes, ",")+")")
	flag.IntVar(&o.contended.n, "contended-n", 5000, "-workload contended: backlog records of the per-record modes (hand, oncely, perkey)")
	flag.IntVar(&o.contended.batchN, "contended-batch-n", 30_000, "-workload contended: records of batch mode and of the ceiling")
	flag.IntVar(&o.contended.batchRecsN, "contended-batch-records-n", 10_000, "-workload contended: records of batch mode with the per-record Handler")
	flag.IntVar(&o.contended.partitions, "contended-partitions", 6, "-workload contended: partitions of the orders topic")
	flag.IntVar(&o.contended.customers, "customers", 50, "-workload contended: customers the orders are spread over")
	flag.StringVar(&o.contended.members, "members", "1,3", "-workload contended: member counts of the consumer group, comma-separated")
	flag.IntVar(&o.contended.batchSize, "contended-batch-size", 100, "-workload contended: BatchSize of the batch modes and transaction size of the ceiling")
	flag.IntVar(&o.contended.keyParallelism, "contended-key-parallelism", 8, "-workload contended: KeyParallelism of the perkey modes (their pools get at least this many connections)")
	flag.DurationVar(&o.contended.timeout, "contended-timeout", 30*time.Second, "-workload contended: limit for one phase of one mode; a mode that does not finish in time fails")
	flag.BoolVar(&o.contended.splitConns, "split-conns", false, "-workload contended: each member of an n-member group gets 1/n of a mode's connections (at least 1), so that the group holds what one member holds")
	flag.StringVar(&o.contended.groupConcurrency, "group-concurrency", "", "-workload contended: Config.GroupConcurrency of the oncely modes, as mode=N pairs, comma-separated (e.g. batch=4,perkey=6); a bare N sets every oncely mode")
	flag.Uint64Var(&o.contended.seed, "seed", 1, "-workload contended: seed of the orders' customers")
	flag.DurationVar(&o.timeout, "timeout", 5*time.Minute, "limit for one phase of one mode")
	flag.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of the whole run to this file")
	flag.BoolVar(&o.progress, "progress", false, "print each second how many records have committed")
	flag.Parse()
	o.given = map[string]bool{}
	flag.Visit(func(f *flag.Flag) { o.given[f.Name] = true })
	if o.workload == workloadContended {
		if !o.given["modes"] {
			o.modes = strings.Join(contendedModes, ",")
		}
		if !o.given["rounds"] {
			o.rounds = 3
		}
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	stopProfile, err := startCPUProfile(o.cpuProfile)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench: cpu profile:", err)
		os.Exit(1)
	}
	defer stopProfile()
	if err := run(ctx, o); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, o options) error {
	if _, ok := compressions[o.compression]; !ok {
		return fmt.Errorf("unknown -compression %q", o.compression)
	}
	if o.effect != effectRow && o.effect != effectOrder {
		return fmt.Errorf("unknown -effect %q (%s or %s)", o.effect, effectRow, effectOrder)
	}
	known := allModes
	switch o.workload {
	case workloadUncontended:
	case workloadContended:
		known = allContendedModes
	default:
		return fmt.Errorf("unknown -workload %q (%s or %s)", o.workload, workloadUncontended, workloadContended)
	}
	modes := strings.Split(o.modes, ",")
	for _, m := range modes {
		if !slices.Contains(known, m) {
			return fmt.Errorf("unknown mode %q (modes of -workload %s: %s)", m, o.workload, strings.Join(known, ","))
		}
	}
	admin, err := pgxpool.New(ctx, o.dbURL)
	if err != nil {
		return err
	}
	defer admin.Close()
	var pgVersion string
	if err := admin.QueryRow(ctx, "SHOW server_version").Scan(&pgVersion); err != nil {
		return fmt.Errorf("postgres at %s: %w", o.dbURL, err)
	}
	b, err := kfakechild.Start(ctx)
	if err != nil {
		return err
	}
	defer b.Stop()
	e := &env{dbURL: o.dbURL, admin: admin, brokers: b.Addrs, brokerPID: b.Cmd.Process.Pid, opts: o}

	fmt.Printf("oncely bench: %s, %d CPUs, %s/%s, Postgres %s, kfake (child process)\n",
		runtime.Version(), runtime.NumCPU(), runtime.GOOS, runtime.GOARCH, pgVersion)
	fmt.Printf("flags: %s\n", strings.Join(os.Args[1:], " "))
	if o.workload == workloadContended {
		return runContended(ctx, e, modes)
	}
	fmt.Printf("settings: rounds=%d n=%d batch-n=%d batch-records-n=%d partitions=%d keys=%d conns=%d batch-size=%d "+
		"latency=%d@%.0f/s key-n=%d key-seq-n=%d key-parallelism=%d key-sleep=%s key-latency=%d@%.0f/s rss-n=%d compression=%s effect=%s\n",
		o.rounds, o.n, o.batchN, o.batchRecsN, o.partitions, o.keys, o.conns, o.batchSize,
		o.latencyRecords, o.latencyRate, o.keyN, o.keySeqN, o.keyParallelism, o.keySleep, o.keyLatencyRecords(), o.keyLatencyRate,
		o.rssN, o.compression, o.effect)
	fmt.Printf("load average at start: %s\n\n", runenv.LoadAverage())

	// Every mode but rss runs once per round; even rounds run the modes in
	// reverse order, so that a drift in the machine's load does not always
	// favour the same ones. rss runs once, last.
	runs := map[string][]result{}
	var order []string
	for _, m := range allModes {
		if slices.Contains(modes, m) && m != modeRSS {
			order = append(order, m)
		}
	}
	for round := 1; round <= o.rounds && ctx.Err() == nil; round++ {
		for _, m := range order {
			if ctx.Err() != nil {
				break
			}
			runs[m] = append(runs[m], e.runLogged(ctx, m, fmt.Sprintf("round %d/%d", round, o.rounds)))
		}
		slices.Reverse(order)
	}
	if slices.Contains(modes, modeRSS) && ctx.Err() == nil {
		runs[modeRSS] = []result{e.runLogged(ctx, modeRSS, "once")}
	}
	report(os.Stdout, o, runs)
	fmt.Printf("load average at end: %s\n", runenv.LoadAverage())
	for _, m := range modes {
		for _, r := range runs[m] {
			if r.err != nil {
				return fmt.Errorf("mode %s failed: %w", m, r.err)
			}
		}
	}
	return ctx.Err()
}

// runLogged runs one mode and says so on standard error.
func (e *env) runLogged(ctx context.Context, m, round string) result {
	start := time.Now()
	fmt.Fprintf(os.Stderr, "bench: %s: %s...", round, m)
	r := e.runMode(ctx, m)
	fmt.Fprintf(os.Stderr, " %s (%.0f records/s)\n", time.Since(start).Round(100*time.Millisecond), r.rate())
	if r.err != nil {
		fmt.Fprintf(os.Stderr, "bench: %s: %v\n", m, r.err)
	}
	return r
}

func (e *env) runMode(ctx context.Context, m string) result {
	o := e.opts
	tw := workload{records: o.n, keys: o.keys, partitions: int32(o.partitions)}
	perRecord := func(name string, inbox bool, fn func(context.Context, kafkaRun) error) kafkaMode {
		return kafkaMode{name: name, w: tw, conns: int32(o.conns), inbox: inbox,
			latencyRecords: o.latencyRecords, latencyRate: o.latencyRate, run: fn}
	}
	switch m {
	case modeCeiling:
		return e.runCeiling(ctx, workload{records: o.batchN, keys: o.keys, partitions: int32(o.partitions)}, int32(o.conns))
	case modeNaive:
		r := e.runKafka(ctx, perRecord("naive at-least-once", false, runNaive))
		r.note = "per-record tx, no inbox"
		return r
	case modeNaiveIn:
		r := e.runKafka(ctx, perRecord("naive + inbox", true, runNaiveInbox))
		r.note = "naive with the hand-written inbox insert"
		return r
	case modePerRecord:
		r := e.runKafka(ctx, perRecord("oncely per-record", true, runOncelyPerRecord))
		r.note = "per-record tx + inbox claim"
		return r
	case modeWatermill:
		r := e.runKafka(ctx, perRecord("watermill", true, runWatermill))
		r.note = "watermill-kafka + hand-written inbox"
		return r
	default:
		return e.runBatchMode(ctx, m)
	}
}
