package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/bench/internal/orderload"
	"github.com/oncely/oncely/bench/internal/runenv"
	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/sqlident"
)

// The -workload values.
const (
	workloadUncontended = "uncontended"
	workloadContended   = "contended"
)

// The contended workload's modes, in the order they run.
const (
	cmHand          = "hand"
	cmOncely        = "oncely"
	cmBatchRecs     = "batch-records"
	cmBatch         = "batch"
	cmPerKey        = "perkey"
	cmCeiling       = "ceiling"
	cmBatchRecsNoCK = "batch-records-nokeys"
	cmPerKeyNoCK    = "perkey-nokeys"
	cmBatchCK       = "batch-keys"
)

// contendedModes run by default; the -nokeys variants and batch-keys only
// when named.
var (
	contendedModes    = []string{cmHand, cmOncely, cmBatchRecs, cmBatch, cmPerKey, cmCeiling}
	allContendedModes = append(append([]string{}, contendedModes...), cmBatchRecsNoCK, cmPerKeyNoCK, cmBatchCK)
)

// contendedOptions are the contended workload's flags.
type contendedOptions struct {
	n, batchN, batchRecsN int    // records of the per-record modes, batch, batch-records (and ceiling: batchN)
	partitions, customers int    // 6 partitions, 50 customers
	members               string // member counts, e.g. "1,3"
	batchSize             int
	keyParallelism        int
	timeout               time.Duration // limit for one phase of one mode (and for the group to settle)
	seed                  uint64
	// splitConns gives each member of an n-member group 1/n of a
	// mode's connections (at least one): the group holds what one
	// member holds, rather than n times as much.
	splitConns bool
	// groupConcurrency is Config.GroupConcurrency per oncely mode
	// (-group-concurrency).
	groupConcurrency string
}

// groupConcurrencyOf returns the -group-concurrency of mode, or 0: its own
// pair, else a bare N.
func (c contendedOptions) groupConcurrencyOf(mode string) (int, error) {
	if c.groupConcurrency == "" {
		return 0, nil
	}
	bare, own := 0, -1
	for _, f := range strings.Split(c.groupConcurrency, ",") {
		m, v, paired := strings.Cut(strings.TrimSpace(f), "=")
		if !paired {
			m, v = "", m
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 || paired && (!contains(allContendedModes, m) || m == cmHand || m == cmCeiling) {
			return 0, fmt.Errorf("invalid -group-concurrency %q: want oncely-mode=N pairs or one N", c.groupConcurrency)
		}
		switch {
		case !paired:
			bare = n
		case m == mode:
			own = n
		}
	}
	if own >= 0 {
		return own, nil
	}
	return bare, nil
}

func (c contendedOptions) memberCounts() ([]int, error) {
	var out []int
	for _, s := range strings.Split(c.members, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 {
			return nil, fmt.Errorf("invalid -members %q", c.members)
		}
		out = append(out, n)
	}
	return out, nil
}

// cresult is one run of one contended mode.
type cresult struct {
	result
	members     int
	deadlocks   int64 // pg_stat_database.deadlocks during the mode
	retries     int64 // consumer.Stats().Retries, or the hand worker's retried transactions
	contention  int64 // consumer.Stats().Contention; -1 where the library has no such counter
	deadLetters int64
	committed   int64 // records committed when the mode stopped (shows progress of a failed mode)
	// ends: when each member committed its last record of the backlog, from
	// the start of the throughput phase (by member).
	ends []time.Duration
}

// endsNote tells, for a group of several members, when each was through
// with its share of the backlog, as a share of the run: the group's rate is
// its slowest member's, and those through early sat idle for the rest.
func (r cresult) endsNote() string {
	if len(r.ends) < 2 || r.elapsed <= 0 {
		return "-"
	}
	ends := slices.Clone(r.ends)
	slices.Sort(ends)
	parts := make([]string, len(ends))
	for i, d := range ends {
		parts[i] = strconv.FormatFloat(d.Seconds()/r.elapsed.Seconds(), 'f', 2, 64)
	}
	return strings.Join(parts, " ")
}

// runContended runs the contended workload (-workload contended): every mode
// with every member count, -rounds times, then the report. It works in a
// database of its own, created for the run and dropped afterwards, so that
// pg_stat_database's deadlock counter sees only the benchmark's sessions.
func runContended(ctx context.Context, e *env, modes []string) error {
	co := e.opts.contended
	counts, err := co.memberCounts()
	if err != nil {
		return err
	}
	ce, drop, err := e.ownDatabase(ctx)
	if err != nil {
		return err
	}
	defer drop()

	fmt.Printf("contended workload: orders keyed by order id over %d partitions, %d customers; n=%d batch-n=%d batch-records-n=%d "+
		"batch-size=%d key-parallelism=%d members=%s conns=%d per member (own pool each) latency=%d@%.0f/s rounds=%d timeout=%s\n",
		co.partitions, co.customers, co.n, co.batchN, co.batchRecsN, co.batchSize, co.keyParallelism, co.members,
		e.opts.conns, e.opts.latencyRecords, e.opts.latencyRate, e.opts.rounds, co.timeout)
	if co.splitConns {
		fmt.Println("-split-conns: each member of an n-member group has 1/n of those connections (at least 1), and as many transactions in flight")
	}
	if co.groupConcurrency != "" {
		if _, err := co.groupConcurrencyOf(cmOncely); err != nil {
			return err
		}
		fmt.Printf("-group-concurrency %s: Config.GroupConcurrency of those modes; each member runs its share by the partitions it holds\n", co.groupConcurrency)
	}
	fmt.Println("ConflictKeys (the customer id) in modes oncely, batch-records, perkey and batch-keys; not in hand, ceiling, the -nokeys modes and batch (the example's set-based handler writes shared rows in customer order)")
	fmt.Printf("load average at start: %s\n\n", runenv.LoadAverage())

	type key struct {
		mode    string
		members int
	}
	runs := map[key][]cresult{}
	var order []key
	for _, m := range allContendedModes {
		if !contains(modes, m) {
			continue
		}
		if m == cmCeiling {
			for _, n := range ceilingConns(e.opts.conns, counts) { // connections, not members
				order = append(order, key{m, n})
			}
			continue
		}
		for _, n := range counts {
			order = append(order, key{m, n})
		}
	}
	for round := 1; round <= e.opts.rounds && ctx.Err() == nil; round++ {
		for _, k := range order {
			if ctx.Err() != nil {
				break
			}
			start := time.Now()
			fmt.Fprintf(os.Stderr, "bench: contended round %d/%d: %s x%d...", round, e.opts.rounds, k.mode, k.members)
			r := ce.runContendedMode(ctx, k.mode, k.members)
			fmt.Fprintf(os.Stderr, " %s (%.0f records/s, %d deadlocks)\n", time.Since(start).Round(100*time.Millisecond), r.rate(), r.deadlocks)
			if r.err != nil {
				fmt.Fprintf(os.Stderr, "bench: %s x%d: %v\n", k.mode, k.members, r.err)
			}
			runs[k] = append(runs[k], r)
		}
		reverse(order)
	}
	byMode := map[string]map[int][]cresult{}
	for k, rs := range runs {
		if byMode[k.mode] == nil {
			byMode[k.mode] = map[int][]cresult{}
		}
		byMode[k.mode][k.members] = rs
	}
	reportContended(os.Stdout, e.opts, counts, byMode)
	fmt.Printf("load average at end: %s\n", runenv.LoadAverage())
	for _, k := range order {
		for _, r := range runs[k] {
			if r.err != nil {
				return fmt.Errorf("contended mode %s x%d failed: %w", k.mode, k.members, r.err)
			}
		}
	}
	return ctx.Err()
}

func contains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

func reverse[T any](s []T) {
	for i, j := 0, len(s)-1; i < j; i, j = i+1, j-1 {
		s[i], s[j] = s[j], s[i]
	}
}

// ownDatabase creates a database for the contended run and returns an env
// on it, and the function that drops it.
func (e *env) ownDatabase(ctx context.Context) (*env, func(), error) {
	u, err := url.Parse(e.dbURL)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return nil, nil, fmt.Errorf("-workload contended needs -database-url in URL form (postgres://...), got %q", e.dbURL)
	}
	name := uniqueName("oncely_bench")
	if _, err := e.admin.Exec(ctx, "CREATE DATABASE "+sqlident.Quote(name)); err != nil {
		return nil, nil, fmt.Errorf("create database for the contended run: %w", err)
	}
	drop := func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		_, _ = e.admin.Exec(dctx, "DROP DATABASE IF EXISTS "+sqlident.Quote(name)+" WITH (FORCE)")
	}
	u.Path = "/" + name
	ce := *e
	ce.dbURL = u.String()
	if ce.admin, err = pgxpool.New(ctx, ce.dbURL); err != nil {
		drop()
		return nil, nil, err
	}
	return &ce, func() { ce.admin.Close(); drop() }, nil
}

// deadlocks reads the database's deadlock counter.
func (e *env) deadlocks(ctx context.Context) (int64, error) {
	var n int64
	err := e.admin.QueryRow(ctx, `SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()`).Scan(&n)
	return n, err
}

// conflictKeys is the workload's consumer.Config.ConflictKeys: the record's
// customer id, so that records of one customer never run in concurrent
// transactions and a batch locks its customers in sorted order.
func conflictKeys(msg *consumer.Message) []string {
	return []string{"customer:" + orderload.CustomerOf(msg.Value)}
}

// cdb is one contended mode's schema: db (oncely's tables, the recorder)
// with the example's tables and one pool per member.
type cdb struct {
	*db
	store *orderload.Store
	pools []*pgxpool.Pool // pools[0] is db.pool
}

func (e *env) newContendedDB(ctx context.Context, mode string, members int, conns int32) (*cdb, error) {
	d, err := e.newDB(ctx, mode, conns)
	if err != nil {
		return nil, err
	}
	c := &cdb{db: d, pools: []*pgxpool.Pool{d.pool}}
	for _, stmt := range orderload.Tables(d.schema) {
		if _, err = d.pool.Exec(ctx, stmt); err != nil {
			break
		}
	}
	if err == nil {
		c.store, err = orderload.NewStore(d.schema)
	}
	for i := 1; i < members && err == nil; i++ {
		var p *pgxpool.Pool
		if p, err = e.memberPool(ctx, d, i, conns); err == nil {
			c.pools = append(c.pools, p)
		}
	}
	if err != nil {
		c.close(ctx, e)
		return nil, err
	}
	return c, nil
}

// memberPool is member's pool on d's schema, traced by the same recorder, as
// another process of the group would have.
func (e *env) memberPool(ctx context.Context, d *db, member int, conns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(e.dbURL)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = d.schema
	cfg.ConnConfig.Tracer = memberTracer{d.rec, member}
	cfg.AfterConnect = func(_ context.Context, c *pgx.Conn) error {
		d.backends.add(c.PgConn().PID())
		return nil
	}
	cfg.MaxConns, cfg.MinConns = conns, conns
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		err = p.Ping(ctx)
	}
	return p, err
}

// closePools closes every pool and waits until their server processes have
// exited: a backend adds its deadlocks to pg_stat_database when it exits (or
// when idle, up to seconds later).
func (c *cdb) closePools(ctx context.Context, e *env) {
	for _, p := range c.pools {
		p.Close()
	}
	c.backends.mu.Lock()
	pids := make([]int32, len(c.backends.pids))
	for i, p := range c.backends.pids {
		pids[i] = int32(p)
	}
	c.backends.mu.Unlock()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		var n int
		if err := e.admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)`, pids).Scan(&n); err != nil || n == 0 {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (c *cdb) close(ctx context.Context, e *env) {
	c.closePools(ctx, e)
	c.db.close(ctx, e.admin)
}

// member is one running consumer of a mode.
type member struct {
	stats func() (retries, contention, deadLetters int64)
}

// cspec says how a contended Kafka mode consumes: run starts member i on
// pool and blocks until ctx is cancelled.
type cspec struct {
	name  string
	note  string
	n     int
	conns int32
	run   func(ctx context.Context, c *cdb, i int, pool *pgxpool.Pool, group, topic string, m *member) error
}

func (e *env) runContendedMode(ctx context.Context, mode string, members int) cresult {
	co := e.opts.contended
	bs := strconv.Itoa(co.batchSize)
	kp := strconv.Itoa(co.keyParallelism)
	oncely := func(name, note string, n int, conns int32, ck bool, tune func(*consumer.Config, *cdb)) cspec {
		if ck {
			note += ", ConflictKeys customer"
		}
		return cspec{name: name, note: note, n: n, conns: conns,
			run: func(ctx context.Context, c *cdb, _ int, pool *pgxpool.Pool, group, topic string, m *member) error {
				cfg := consumer.Config{
					Brokers: e.brokers, Topics: []string{topic}, Group: group, Pool: pool, Schema: c.schema,
					Handler: func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
						o, err := orderload.Decode(msg.Value)
						if err != nil {
							return dlq.Undecodable(err)
						}
						if err := c.store.Apply(ctx, tx, o, sourceOf(msg)); err != nil {
							return err
						}
						c.rec.note(tx.Conn(), time.Unix(0, o.SentNS))
						return nil
					},
				}
				if ck {
					cfg.ConflictKeys = conflictKeys
				}
				if tune != nil {
					tune(&cfg, c)
				}
				cfg.GroupConcurrency, _ = co.groupConcurrencyOf(mode) // checked by runContended
				cons, err := consumer.New(cfg)
				if err != nil {
					return err
				}
				m.stats = func() (int64, int64, int64) {
					s := cons.Stats()
					return s.Retries, s.Contention, s.DeadLettered
				}
				return cons.Run(ctx)
			}}
	}
	conns := int32(e.opts.conns)
	var s cspec
	switch mode {
	case cmCeiling:
		return e.runContendedCeiling(ctx, members)
	case cmHand:
		s = cspec{name: "hand-written per-record", note: "franz-go + pgx, tx per record, retries contention", n: co.n, conns: conns,
			run: func(ctx context.Context, c *cdb, i int, pool *pgxpool.Pool, group, topic string, m *member) error {
				h := orderload.NewHand(orderload.HandConfig{Brokers: e.brokers, Topic: topic, Group: group, Pool: pool, Store: c.store,
					Applied: func(tx pgx.Tx, o orderload.Order) { c.rec.note(tx.Conn(), time.Unix(0, o.SentNS)) }})
				m.stats = func() (int64, int64, int64) { return h.Retries(), -1, 0 }
				return h.Run(ctx)
			}}
	case cmOncely:
		s = oncely("oncely per-record", "consumer defaults", co.n, conns, true, nil)
	case cmBatchRecs, cmBatchRecsNoCK:
		s = oncely("oncely batch, Handler", "BatchSize "+bs+", per-record Handler", co.batchRecsN, conns, mode == cmBatchRecs,
			func(cfg *consumer.Config, _ *cdb) { cfg.BatchSize = co.batchSize })
		if mode == cmBatchRecsNoCK {
			s.name += ", no keys"
		}
	case cmBatch, cmBatchCK:
		// The example's default runs without conflict keys: its handler
		// writes the shared rows (balances, then the outbox's per-customer
		// locks) in customer order, so batches wait on each other only
		// while one commits, and never deadlock. batch-keys shows what the
		// keys would cost it: whole batches taking turns.
		s = oncely("oncely batch (example)", "BatchSize "+bs+", set-based BatchHandler", co.batchN, conns, mode == cmBatchCK,
			func(cfg *consumer.Config, c *cdb) {
				cfg.BatchSize = co.batchSize
				if mode == cmBatch {
					cfg.BatchLockTimeout = -1 // as the example: its waits end at a commit
				}
				cfg.BatchHandler = func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
					orders := make([]orderload.Order, len(msgs))
					srcs := make([]orderload.Source, len(msgs))
					for i, msg := range msgs {
						o, err := orderload.Decode(msg.Value)
						if err != nil {
							return dlq.Undecodable(err)
						}
						orders[i], srcs[i] = o, sourceOf(msg)
					}
					if err := c.store.ApplyMany(ctx, tx, orders, srcs); err != nil {
						return err
					}
					for _, o := range orders {
						c.rec.note(tx.Conn(), time.Unix(0, o.SentNS))
					}
					return nil
				}
			})
		if mode == cmBatchCK {
			s.name = "oncely batch, keys"
		}
	case cmPerKey, cmPerKeyNoCK:
		s = oncely("oncely per-key", "KeyParallelism "+kp+", per-record Handler", co.n, max(conns, int32(co.keyParallelism)), mode == cmPerKey,
			func(cfg *consumer.Config, _ *cdb) { cfg.KeyParallelism = co.keyParallelism })
		if mode == cmPerKeyNoCK {
			s.name += ", no keys"
		}
	default:
		panic("unknown contended mode " + mode)
	}
	r := e.runContendedKafka(ctx, s, members)
	r.note = s.note
	return r
}

func sourceOf(msg *consumer.Message) orderload.Source {
	return orderload.Source{MessageID: msg.ID, Topic: msg.Topic, Partition: msg.Partition, Offset: msg.Offset}
}

// runContendedKafka measures one contended Kafka mode with members
// consumers of one group, as runKafka does a mode of the uncontended
// workload: backlog produced first, throughput from the first statement to
// the n-th record's commit, then the latency phase, then verification; and
// the deadlocks of the database during the mode.
func (e *env) runContendedKafka(ctx context.Context, s cspec, members int) (res cresult) {
	co := e.opts.contended
	res = cresult{result: result{mode: s.name, records: s.n}, members: members, contention: -1}
	conns := s.conns
	if co.splitConns {
		conns = max(1, conns/int32(members))
	}
	c, err := e.newContendedDB(ctx, s.name, members, conns)
	if err != nil {
		res.err = err
		return res
	}
	defer c.close(ctx, e)
	topic, err := e.newContendedTopic(ctx, s.name)
	if err != nil {
		res.err = err
		return res
	}
	defer e.deleteTopic(ctx, topic)
	total := s.n + e.opts.latencyRecords
	p, err := e.newOrderProducer(topic, orderload.NewGen(total, co.customers, co.seed))
	if err != nil {
		res.err = err
		return res
	}
	defer p.close()
	before, err := e.deadlocks(ctx)
	if err != nil {
		res.err = err
		return res
	}

	// The members join first and the backlog follows once the group is
	// stable: a mode's figure is the group's steady work, not how long
	// members that start one after another take to rebalance.
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	group := uniqueName("bench")
	ms := make([]*member, members)
	errs := make([]error, members)
	var wg sync.WaitGroup
	var running atomic.Int32
	done := make(chan struct{})
	for i := range members {
		ms[i] = &member{}
		running.Add(1)
		wg.Go(func() {
			defer func() {
				if running.Add(-1) == 0 {
					close(done)
				}
			}()
			errs[i] = s.run(runCtx, c, i, c.pools[i], group, topic, ms[i])
			if errs[i] != nil && runCtx.Err() == nil {
				stop() // one member failed: stop the mode
			}
		})
	}
	stopRun := func() error {
		stop()
		wg.Wait()
		var out []error
		for i, err := range errs {
			if err != nil && !errors.Is(err, context.Canceled) {
				out = append(out, fmt.Errorf("member %d: %w", i, err))
			}
		}
		return errors.Join(out...)
	}
	finish := func() {
		for _, m := range ms {
			if m.stats != nil {
				r, ct, dl := m.stats()
				res.retries += r
				res.deadLetters += dl
				if ct >= 0 {
					res.contention = max(res.contention, 0) + ct
				}
			}
		}
		res.committed = c.rec.done.Load()
		c.closePools(ctx, e)
		if after, err := e.deadlocks(ctx); err == nil {
			res.deadlocks = after - before
		}
	}

	stable := runenv.WaitStable(runCtx, e.brokers, group, topic, members, co.partitions, co.timeout)
	meter := e.cpuMeter(c.db)
	var cpuStart cpuUse
	if stable == nil {
		cpuStart = meter.read()
		c.rec.arm()
		t0 := time.Now()
		stable = p.backlog(ctx, 0, s.n)
		fmt.Fprintf(os.Stderr, " [backlog produced in %s]", time.Since(t0).Round(time.Millisecond))
	}
	if stable != nil {
		res.err = errors.Join(stable, stopRun())
		finish()
		return res
	}
	if err := waitCommitted(c.rec.expect(int64(s.n)), done, co.timeout); err != nil {
		res.err = fmt.Errorf("throughput phase: %w", errors.Join(err, stopRun()))
		finish()
		res.err = fmt.Errorf("%w (%d of %d records committed)", res.err, res.committed, s.n)
		return res
	}
	res.cpu = meter.read().since(cpuStart)
	res.elapsed = time.Duration(c.rec.lastDone.Load() - c.rec.firstTx.Load())
	res.perTx = float64(s.n) / float64(max(c.rec.txs.Load(), 1))
	res.ends = c.rec.memberEnds(members)

	reached := c.rec.expectLatencies(int64(total))
	if err := p.paced(ctx, s.n, total, e.opts.latencyRate); err != nil {
		res.err = fmt.Errorf("latency phase: %w", errors.Join(err, stopRun()))
		finish()
		return res
	}
	if err := waitCommitted(reached, done, co.timeout); err != nil {
		res.err = fmt.Errorf("latency phase: %w", errors.Join(err, stopRun()))
		finish()
		return res
	}
	res.latencies = c.rec.latencies()
	if err := stopRun(); err != nil {
		res.err = fmt.Errorf("consumer: %w", err)
	}
	if _, err := c.store.Verify(ctx, c.pool, int64(total)); err != nil && res.err == nil {
		res.err = err
	}
	finish()
	if res.err == nil && res.deadLetters > 0 {
		res.err = fmt.Errorf("%d records dead-lettered", res.deadLetters)
	}
	return res
}

// newContendedTopic creates a mode's topic with the workload's partitions,
// and its dead-letter topic (kfake creates no topic on first use).
func (e *env) newContendedTopic(ctx context.Context, mode string) (string, error) {
	topic := uniqueName("bench-" + sqlIdent(mode))
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.brokers...))
	if err != nil {
		return "", err
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	for _, t := range []struct {
		name  string
		parts int32
	}{{topic, int32(e.opts.contended.partitions)}, {dlq.DefaultTopic(topic), 1}} {
		resp, err := adm.CreateTopic(ctx, t.parts, 1, nil, t.name)
		if err == nil {
			err = resp.Err
		}
		if err != nil {
			return "", fmt.Errorf("create topic %s: %w", t.name, err)
		}
	}
	return topic, nil
}

// newOrderProducer writes the contended workload's records: order i, keyed by
// its order id, to partition i mod partitions (keyed by order id, so every
// partition carries every customer), with its message id in the message-id
// header and its produce time in the value.
func (e *env) newOrderProducer(topic string, gen orderload.Gen) (*producer, error) {
	parts := e.opts.contended.partitions
	return e.newRecordProducer(func(i int, sent time.Time) (*kgo.Record, error) {
		o := gen.Order(i, sent.UnixNano())
		v, err := json.Marshal(o)
		if err != nil {
			return nil, err
		}
		return &kgo.Record{Topic: topic, Partition: int32(i % parts), Key: []byte(o.OrderID), Value: v,
			Headers: []kgo.RecordHeader{{Key: consumer.DefaultMessageIDHeader, Value: []byte(orderload.MessageID(i))}}}, nil
	})
}

// ceilingConns are the connection counts the ceiling runs with: 1, 4 (what
// the other modes' ratios are to), and as many as the largest group's
// members hold together (conns each), to show what that many concurrent
// transactions cost Postgres itself on this machine.
func ceilingConns(conns int, counts []int) []int {
	out := []int{1, 4}
	if most := conns * slices.Max(counts); most > 4 {
		out = append(out, most)
	}
	return out
}

// runContendedCeiling is the set-based raw-SQL ceiling of the workload, no
// Kafka: transactions of batch-size orders, each one multi-row inbox claim
// (dedup.Inbox.ClaimMany), one multi-row insert of the orders, the balances
// summed per customer and upserted in customer order, and the events in one
// Enqueue, on conns connections at once.
func (e *env) runContendedCeiling(ctx context.Context, conns int) (res cresult) {
	co := e.opts.contended
	w := co.batchN
	res = cresult{result: result{mode: "raw-SQL ceiling", records: w,
		note: fmt.Sprintf("set-based batches of %d, %d conn(s)", co.batchSize, conns)}, members: conns, contention: -1}
	c, err := e.newContendedDB(ctx, "ceiling", 1, int32(conns))
	if err != nil {
		res.err = err
		return res
	}
	defer c.close(ctx, e)
	inbox, err := dedup.New(dedup.Config{Schema: c.schema})
	if err != nil {
		res.err = err
		return res
	}
	gen := orderload.NewGen(w, co.customers, co.seed)
	group := uniqueName("bench")
	before, err := e.deadlocks(ctx)
	if err != nil {
		res.err = err
		return res
	}
	var (
		next    atomic.Int64
		mu      sync.Mutex
		samples []time.Duration
		retries atomic.Int64
		errs    = make([]error, conns)
		wg      sync.WaitGroup
	)
	size := co.batchSize
	meter := e.cpuMeter(c.db)
	cpuStart := meter.read()
	start := time.Now()
	for ci := range conns {
		wg.Go(func() {
			for {
				from := int(next.Add(int64(size))) - size
				if from >= w {
					return
				}
				to := min(from+size, w)
				orders := make([]orderload.Order, to-from)
				srcs := make([]orderload.Source, to-from)
				entries := make([]dedup.Entry, to-from)
				for j := range orders {
					i := from + j
					orders[j] = gen.Order(i, 0)
					srcs[j] = orderload.Source{MessageID: orderload.MessageID(i), Topic: "ceiling", Partition: int32(i % co.partitions), Offset: int64(i)}
					entries[j] = dedup.Entry{MessageID: srcs[j].MessageID, Topic: "ceiling", Partition: srcs[j].Partition, Offset: srcs[j].Offset}
				}
				for {
					t0 := time.Now()
					err := pgx.BeginFunc(ctx, c.pool, func(tx pgx.Tx) error {
						if _, err := inbox.ClaimMany(ctx, tx, group, entries); err != nil {
							return err
						}
						return c.store.ApplyMany(ctx, tx, orders, srcs)
					})
					if err == nil {
						mu.Lock()
						samples = append(samples, time.Since(t0))
						mu.Unlock()
						break
					}
					if !orderload.Retryable(err) {
						errs[ci] = err
						return
					}
					retries.Add(1)
				}
			}
		})
	}
	wg.Wait()
	res.elapsed = time.Since(start)
	res.cpu = meter.read().since(cpuStart)
	res.retries = retries.Load()
	if res.err = errors.Join(errs...); res.err == nil {
		res.latencies = samples
		res.perTx = float64(w) / float64(max(len(samples), 1))
		_, res.err = c.store.Verify(ctx, c.pool, int64(w))
	}
	res.committed = int64(w)
	c.closePools(ctx, e)
	if after, err := e.deadlocks(ctx); err == nil {
		res.deadlocks = after - before
	}
	return res
}
