package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/oncely/oncely/bench/internal/runenv"
	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/internal/sqlident"
	"github.com/oncely/oncely/migrations"
	"github.com/oncely/oncely/natsconsumer"
)

// natsCommand is the argument that selects the JetStream benchmark:
//
//	cd bench && go run . nats [flags]      (or: make bench-nats)
const natsCommand = "nats"

// The JetStream modes, in the order of the first round.
const (
	natsHand      = "hand"          // pull Fetch; per message: BEGIN, inbox insert, effect, COMMIT, Ack
	natsPerRecord = "oncely"        // natsconsumer, a transaction per message
	natsBatch     = "batch"         // natsconsumer, BatchSize messages a transaction, a BatchHandler's multi-row insert
	natsBatchRecs = "batch-records" // natsconsumer, BatchSize messages a transaction, the Handler under a savepoint each
	natsGroup     = "bench"         // the durable's name, and the inbox's consumer group
	natsIDHeader  = "message-id"    // each message's id
)

var natsModes = []string{natsHand, natsPerRecord, natsBatch, natsBatchRecs}

type natsOptions struct {
	dbURL, natsURL string
	n, batchN      int
	rounds         int
	concurrency    int
	batchSize      int
	handFetch      int
	storage        string
	timeout        time.Duration
	modes          string
	cpuProfile     string
}

// natsRound is one mode's result in one round.
type natsRound struct {
	rate    float64       // messages/s
	elapsed time.Duration // from the consumer's start to the last message's commit
	cpu     time.Duration // this process's CPU time per message
}

// runNATS measures, in one run and on one workload, a hand-written
// JetStream consumer against natsconsumer per message and in batch mode:
// each round, for each mode, n messages are published to a fresh stream
// (file storage), then a fresh durable consumes them; each message's
// effect is one row inserted in its transaction. Rounds rotate the modes'
// order.
func runNATS(args []string) error {
	var o natsOptions
	fs := flag.NewFlagSet(natsCommand, flag.ExitOnError)
	fs.StringVar(&o.dbURL, "database-url", cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "Postgres to measure against (a fresh schema, dropped afterwards)")
	fs.StringVar(&o.natsURL, "nats-url", cmp.Or(os.Getenv("NATS_URL"), nats.DefaultURL), "NATS server with JetStream (a fresh stream per mode and round, deleted afterwards)")
	fs.IntVar(&o.n, "n", 10_000, "messages per round of the hand-written and per-message modes")
	fs.IntVar(&o.batchN, "batch-n", 50_000, "messages per round of the batch modes (a run long enough that the start-up's round trips do not count)")
	fs.IntVar(&o.rounds, "rounds", 5, "rounds; the table shows medians, the targets the median of each round's ratio")
	fs.IntVar(&o.concurrency, "concurrency", 4, "transactions in flight, in every mode (goroutines of the hand-written consumer; Config.Concurrency of natsconsumer) and the pool's size")
	fs.IntVar(&o.batchSize, "batch-size", 200, "natsconsumer Config.BatchSize of batch mode")
	fs.IntVar(&o.handFetch, "hand-fetch", 100, "messages per Fetch of the hand-written consumer")
	fs.StringVar(&o.storage, "storage", "file", "the streams' storage: file or memory")
	fs.DurationVar(&o.timeout, "timeout", 5*time.Minute, "limit for one mode in one round")
	fs.StringVar(&o.modes, "modes", strings.Join(natsModes, ","), "modes to run, comma-separated (the ratios need "+natsHand+")")
	fs.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of the whole run to this file")
	_ = fs.Parse(args)
	if o.cpuProfile != "" {
		f, err := os.Create(o.cpuProfile)
		if err == nil {
			err = pprof.StartCPUProfile(f)
		}
		if err != nil {
			return fmt.Errorf("nats: cpu profile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}
	modes := strings.Split(o.modes, ",")
	for _, m := range modes {
		if !slices.Contains(natsModes, m) {
			return fmt.Errorf("nats: unknown mode %q (%s)", m, strings.Join(natsModes, ","))
		}
	}
	if o.n <= 0 || o.batchN <= 0 || o.rounds <= 0 || o.concurrency <= 0 || o.batchSize <= 1 || o.handFetch <= 0 {
		return errors.New("nats: -n, -rounds, -concurrency and -hand-fetch must be positive, -batch-size above 1")
	}
	storage := jetstream.FileStorage
	switch o.storage {
	case "file":
	case "memory":
		storage = jetstream.MemoryStorage
	default:
		return fmt.Errorf("nats: -storage %q: want file or memory", o.storage)
	}
	ctx := context.Background()

	nc, err := nats.Connect(o.natsURL)
	if err != nil {
		return fmt.Errorf("nats at %s: %w", o.natsURL, err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}

	schema := uniqueName("bench_nats")
	pcfg, err := pgxpool.ParseConfig(o.dbURL)
	if err != nil {
		return err
	}
	pcfg.ConnConfig.RuntimeParams["search_path"] = schema
	pcfg.MaxConns, pcfg.MinConns = int32(o.concurrency), int32(o.concurrency)
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+sqlident.Quote(schema)); err != nil {
		return fmt.Errorf("create schema: %w", err)
	}
	defer func() { _, _ = pool.Exec(context.WithoutCancel(ctx), "DROP SCHEMA "+sqlident.Quote(schema)+" CASCADE") }()
	mig, err := migrations.New(pool, migrations.Config{Schema: schema})
	if err != nil {
		return err
	}
	if _, err := mig.Up(ctx); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE effects (message_id text NOT NULL, seq bigint NOT NULL)`); err != nil {
		return err
	}

	fmt.Printf("JetStream benchmark: %d messages a round (%d in the batch modes, %s storage), %d transactions in flight, batch size %d, hand-written Fetch %d, %d rounds, load average %s\n",
		o.n, o.batchN, o.storage, o.concurrency, o.batchSize, o.handFetch, o.rounds, runenv.LoadAverage())
	results := map[string][]natsRound{}
	var perRecordRatios, batchRatios, batchRecsRatios []float64
	for round := range o.rounds {
		order := append(slices.Clone(modes[round%len(modes):]), modes[:round%len(modes)]...)
		for _, m := range order {
			if _, err := pool.Exec(ctx, `TRUNCATE effects, inbox`); err != nil {
				return err
			}
			n := o.n
			if m == natsBatch || m == natsBatchRecs {
				n = o.batchN
			}
			stream := strings.ToUpper(uniqueName("BENCH"))
			if err := natsPublish(ctx, js, stream, storage, n); err != nil {
				return fmt.Errorf("%s: publish: %w", m, err)
			}
			res, err := natsMode(ctx, m, js, stream, pool, schema, n, o)
			derr := js.DeleteStream(context.WithoutCancel(ctx), stream)
			if err != nil {
				return fmt.Errorf("round %d, %s: %w", round+1, m, err)
			}
			if derr != nil {
				return fmt.Errorf("delete stream %s: %w", stream, derr)
			}
			var effects int64
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM effects`).Scan(&effects); err != nil {
				return err
			}
			if effects != int64(n) {
				return fmt.Errorf("round %d, %s: %d effects for %d messages", round+1, m, effects, n)
			}
			results[m] = append(results[m], res)
		}
		if len(modes) < len(natsModes) {
			for _, m := range modes {
				fmt.Printf("round %d: %s %.0f msg/s, CPU %s/msg\n", round+1, natsLabel(m, o), results[m][round].rate, results[m][round].cpu)
			}
			continue
		}
		hand := results[natsHand][round].rate
		pr, b, br := results[natsPerRecord][round].rate/hand, results[natsBatch][round].rate/hand, results[natsBatchRecs][round].rate/hand
		perRecordRatios, batchRatios, batchRecsRatios = append(perRecordRatios, pr), append(batchRatios, b), append(batchRecsRatios, br)
		fmt.Printf("round %d:", round+1)
		for _, m := range natsModes {
			r := results[m][round]
			fmt.Printf(" %s %.0f msg/s (%.2f×, CPU %s/msg);", m, r.rate, r.rate/hand, r.cpu.Round(100*time.Nanosecond))
		}
		fmt.Println()
	}

	if len(modes) < len(natsModes) {
		return nil
	}
	median := func(xs []float64) float64 {
		xs = slices.Clone(xs)
		slices.Sort(xs)
		return xs[len(xs)/2]
	}
	fmt.Printf("\n%-40s %9s %12s %12s\n", "mode", "messages", "msg/s", "CPU/msg")
	for _, m := range natsModes {
		cpus := make([]float64, len(results[m]))
		for i, r := range results[m] {
			cpus[i] = float64(r.cpu)
		}
		n := o.n
		if m == natsBatch || m == natsBatchRecs {
			n = o.batchN
		}
		fmt.Printf("%-40s %9d %12.0f %12s\n", natsLabel(m, o), n, median(rates(results[m])), time.Duration(median(cpus)).Round(100*time.Nanosecond))
	}
	fmt.Println("(msg/s and CPU/msg, this process's: the medians of the rounds)")
	verdict := func(ok bool) string {
		if ok {
			return "met"
		}
		return "NOT met"
	}
	pr, b, br := median(perRecordRatios), median(batchRatios), median(batchRecsRatios)
	fmt.Printf("\ntargets (median of the rounds' ratios to the hand-written consumer of the same round):\n")
	fmt.Printf("  oncely per-message                ≥ 1× hand: %.2f× %.2f (%s)\n", pr, perRecordRatios, verdict(pr >= 1))
	fmt.Printf("  oncely batch, BatchHandler        ≥ 5× hand: %.2f× %.2f (%s)\n", b, batchRatios, verdict(b >= 5))
	fmt.Printf("  oncely batch, Handler per message ≥ 5× hand: %.2f× %.2f (%s)\n", br, batchRecsRatios, verdict(br >= 5))
	return nil
}

func rates(rs []natsRound) []float64 {
	out := make([]float64, len(rs))
	for i, r := range rs {
		out[i] = r.rate
	}
	return out
}

func natsLabel(m string, o natsOptions) string {
	switch m {
	case natsHand:
		return fmt.Sprintf("hand-written (Fetch %d)", o.handFetch)
	case natsPerRecord:
		return "oncely per-message"
	case natsBatch:
		return fmt.Sprintf("oncely batch %d, BatchHandler", o.batchSize)
	}
	return fmt.Sprintf("oncely batch %d, Handler per message", o.batchSize)
}

// natsPublish creates stream (subject <stream>.orders) and stores n
// messages in it, each with a unique message-id header, waiting for every
// PubAck.
func natsPublish(ctx context.Context, js jetstream.JetStream, stream string, storage jetstream.StorageType, n int) error {
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{stream + ".>"}, Storage: storage}); err != nil {
		return err
	}
	// The dead-letter stream natsconsumer checks for at start-up.
	if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{Name: stream + "_DLQ", Subjects: []string{"dlq." + stream + ".>"}, Storage: storage}); err != nil {
		return err
	}
	subject := stream + ".orders"
	for i := range n {
		m := nats.NewMsg(subject)
		m.Data = []byte(`{"order":` + strconv.Itoa(i) + `,"sku":"A-1","qty":1}`)
		m.Header.Set(natsIDHeader, stream+"-"+strconv.Itoa(i))
		if _, err := js.PublishMsgAsync(m); err != nil {
			return err
		}
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-time.After(time.Minute):
		return errors.New("PubAcks did not all arrive within a minute")
	case <-ctx.Done():
		return ctx.Err()
	}
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return err
	}
	if info.State.Msgs != uint64(n) {
		return fmt.Errorf("stream holds %d messages, want %d", info.State.Msgs, n)
	}
	return nil
}

// natsMode consumes the stream's n messages with mode m and times it.
func natsMode(ctx context.Context, m string, js jetstream.JetStream, stream string, pool *pgxpool.Pool, schema string, n int, o natsOptions) (natsRound, error) {
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	var done func() int64
	errc := make(chan error, 1)
	start, cpu0 := time.Now(), selfCPU()
	switch m {
	case natsHand:
		h := &natsHandConsumer{js: js, stream: stream, pool: pool, fetch: o.handFetch, workers: o.concurrency}
		done = h.processed.Load
		go func() { errc <- h.run(runCtx) }()
	default:
		effect := func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects (message_id, seq) VALUES ($1, $2)`, msg.ID, msg.Offset)
			return err
		}
		cfg := natsconsumer.Config{JetStream: js, Stream: stream, Durable: natsGroup, Pool: pool, Schema: schema,
			Handler: effect, Concurrency: o.concurrency}
		switch m {
		case natsBatch:
			// The same rows, written by one multi-row insert.
			cfg.Handler, cfg.BatchSize = nil, o.batchSize
			cfg.BatchHandler = func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
				ids, seqs := make([]string, len(msgs)), make([]int64, len(msgs))
				for i, msg := range msgs {
					ids[i], seqs[i] = msg.ID, msg.Offset
				}
				_, err := tx.Exec(ctx, `INSERT INTO effects (message_id, seq) SELECT * FROM unnest($1::text[], $2::bigint[])`, ids, seqs)
				return err
			}
		case natsBatchRecs:
			cfg.BatchSize = o.batchSize
		}
		c, err := natsconsumer.New(cfg)
		if err != nil {
			return natsRound{}, err
		}
		done = func() int64 { return c.Stats().Processed }
		go func() { errc <- c.Run(runCtx) }()
	}
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for done() < int64(n) {
		select {
		case err := <-errc:
			return natsRound{}, fmt.Errorf("stopped after %d messages: %v", done(), err)
		case <-ctx.Done():
			return natsRound{}, fmt.Errorf("%d of %d messages in %s", done(), n, o.timeout)
		case <-tick.C:
		}
	}
	elapsed, cpu := time.Since(start), selfCPU()-cpu0
	stop()
	if err := <-errc; err != nil {
		return natsRound{}, err
	}
	return natsRound{rate: float64(n) / elapsed.Seconds(), elapsed: elapsed, cpu: cpu / time.Duration(n)}, nil
}

// natsHandConsumer is the hand-written baseline: jetstream's pull Fetch and
// pgx, without oncely. workers goroutines each fetch up to fetch messages
// and, per message: BEGIN; INSERT into oncely's inbox table (as a user who
// migrated oncely's schema would) ON CONFLICT DO NOTHING;
// the effect only for a new id; COMMIT; Ack (not waiting for the server's
// confirmation: a lost ack is a redelivery, which the inbox absorbs).
type natsHandConsumer struct {
	js        jetstream.JetStream
	stream    string
	pool      *pgxpool.Pool
	fetch     int
	workers   int
	processed atomic.Int64
}

func (h *natsHandConsumer) run(ctx context.Context) error {
	cons, err := h.js.CreateOrUpdateConsumer(ctx, h.stream, jetstream.ConsumerConfig{
		Durable: natsGroup, AckPolicy: jetstream.AckExplicitPolicy, AckWait: 30 * time.Second,
		MaxAckPending: 2 * h.workers * h.fetch,
	})
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	errs := make(chan error, h.workers)
	for range h.workers {
		wg.Go(func() {
			for ctx.Err() == nil {
				batch, err := cons.Fetch(h.fetch, jetstream.FetchMaxWait(time.Second))
				if err != nil {
					errs <- err
					return
				}
				for msg := range batch.Messages() {
					if err := h.message(ctx, msg); err != nil {
						if ctx.Err() == nil {
							errs <- err
						}
						return
					}
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	return <-errs // nil when none failed
}

func (h *natsHandConsumer) message(ctx context.Context, msg jetstream.Msg) error {
	md, err := msg.Metadata()
	if err != nil {
		return err
	}
	id := msg.Headers().Get(natsIDHeader)
	err = pgx.BeginFunc(ctx, h.pool, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, `INSERT INTO inbox (consumer_group, message_id, topic, "offset") VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING`,
			natsGroup, id, msg.Subject(), int64(md.Sequence.Stream))
		if err != nil || tag.RowsAffected() == 0 {
			return err // a duplicate: nothing more to do
		}
		_, err = tx.Exec(ctx, `INSERT INTO effects (message_id, seq) VALUES ($1, $2)`, id, int64(md.Sequence.Stream))
		return err
	})
	if err != nil {
		return err
	}
	h.processed.Add(1)
	return msg.Ack()
}
