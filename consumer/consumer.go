package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/backoff"
	"github.com/oncely/oncely/internal/brokercheck"
	"github.com/oncely/oncely/internal/ratelog"
	"github.com/oncely/oncely/internal/sqlident"
	"github.com/oncely/oncely/internal/telemetry"
	"github.com/oncely/oncely/internal/testhook"
)

// Consumer is one member of a Kafka consumer group whose handler's effects
// happen once per (group, message id). Create it with New and run it with Run.
type Consumer struct {
	cfg     Config
	inbox   *dedup.Inbox
	owners  *ownerQueries // nil: crash-loop detection is off (CrashLoopLimit < 0)
	backoff backoff.Policy
	started atomic.Bool

	// ready: the poll loop runs, a broker answers, and no partition waits
	// (see NotReady).
	polling atomic.Bool
	live    atomic.Pointer[run] // the running Run, for NotReady

	// fallbacks rate-limits the WARN of records without a message id, per
	// partition (tp -> *fallbackLog).
	fallbacks sync.Map

	system  attribute.KeyValue // messaging.system
	tracer  trace.Tracer
	meter   metric.Meter
	metrics *instruments
	// outage writes the warnings that repeat while the database or the
	// brokers are down, at most one of a kind per LogInterval.
	outage *ratelog.Limiter
	// inboxCount is the last exact count of the inbox (see inboxRows).
	inboxCount struct {
		sync.Mutex
		at   time.Time
		rows int64
	}

	// handler runs one record: Handler, or BatchHandler with a batch of one.
	handler Handler

	attrSets  sync.Map // attrKey -> metric.MeasurementOption
	spanAttrs sync.Map // topic -> trace.SpanStartEventOption

	processed, duplicates, retries, commits, held atomic.Int64
	limit                                         atomic.Int64 // Stats.Concurrency
	deadLettered, deadLetterErrs, batches         atomic.Int64
	contention, crashProbes, crashLoops           atomic.Int64
	serialUntil                                   atomic.Int64 // unix ns: see lostToContention
	gate                                          conflictGate
	// waker sends the outbox wake-ups of committed transactions, after
	// their commits.
	waker *waker
}

// New validates cfg and returns a Consumer. Errors name the offending field
// and wrap ErrInvalidConfig.
func New(cfg Config) (*Consumer, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	inbox, err := dedup.New(dedup.Config{Schema: cfg.Schema})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	meter := telemetry.Meter(cfg.MeterProvider)
	metrics, err := newInstruments(meter, &cfg)
	if err != nil {
		return nil, err
	}
	handler := cfg.Handler
	if handler == nil {
		bh := cfg.BatchHandler
		handler = func(ctx context.Context, tx pgx.Tx, msg *Message) error {
			if err := bh(ctx, tx, []*Message{msg}); err != nil {
				return err
			}
			return msg.failed
		}
	}
	var owners *ownerQueries
	if cfg.CrashLoopLimit > 0 {
		owners = newOwnerQueries(cfg.Schema)
	}
	outage := ratelog.New(cfg.Logger, cfg.LogInterval)
	c := &Consumer{
		system:  systemAttr(&cfg),
		owners:  owners,
		handler: handler,
		cfg:     cfg,
		inbox:   inbox,
		backoff: backoff.Policy{Base: cfg.RetryBaseDelay, Max: cfg.RetryMaxDelay},
		tracer:  telemetry.Tracer(cfg.TracerProvider),
		meter:   meter,
		metrics: metrics,
		outage:  outage,
		waker:   newWaker(cfg.Pool, outage),
	}
	c.limit.Store(int64(cfg.Concurrency))
	return c, nil
}

// Stats returns the consumer's counters.
func (c *Consumer) Stats() Stats {
	return Stats{
		Processed:      c.processed.Load(),
		Duplicates:     c.duplicates.Load(),
		Retries:        c.retries.Load(),
		DeadLettered:   c.deadLettered.Load(),
		DeadLetterErrs: c.deadLetterErrs.Load(),
		OffsetCommits:  c.commits.Load(),
		Batches:        c.batches.Load(),
		PartitionsHeld: c.held.Load(),
		Concurrency:    c.limit.Load(),
		Contention:     c.contention.Load(),
		CrashProbes:    c.crashProbes.Load(),
		CrashLoops:     c.crashLoops.Load(),
		TurnWaits:      c.gate.waits.Load(),
	}
}

// Ready reports whether Run is consuming, a broker answers, and no
// partition of this member waits: for the database, for its dead-letter
// topic, or on one record for longer than StuckAfter. Use it for readiness
// probes; NotReady says why it is false.
func (c *Consumer) Ready() bool { return c.NotReady() == "" }

// NotReady says why Ready is false, for a readiness probe's answer; "" when
// it is true: not consuming, the brokers that do not answer, or each
// partition that waits and on what (the first few, and how many more).
func (c *Consumer) NotReady() string {
	r := c.live.Load()
	if r != nil {
		if why, down := r.brokers.Down(); down {
			return why
		}
	}
	if r == nil || !c.polling.Load() {
		return "not consuming (starting, stopped or failed)"
	}
	now := time.Now()
	var reasons []string
	for _, w := range r.snapshot() {
		if why := w.unready(now); why != "" {
			reasons = append(reasons, why)
		}
	}
	slices.Sort(reasons)
	if n := len(reasons); n > maxReasons {
		reasons = append(reasons[:maxReasons], fmt.Sprintf("and %d more partitions", n-maxReasons))
	}
	return strings.Join(reasons, "; ")
}

// maxReasons bounds the partitions NotReady names.
const maxReasons = 5

type tp struct {
	topic     string
	partition int32
}

// run is the state of one Run call.
type run struct {
	c     *Consumer
	cl    *kgo.Client
	hooks *testhook.Consumer

	cancelPoll context.CancelFunc // stops the poll loop
	workCtx    context.Context    // parent of worker contexts; survives Run's ctx for the drain

	// slots bounds the transactions in flight (Config.Concurrency).
	slots chan struct{}
	// reshare asks shareLoop for a new share of Config.GroupConcurrency;
	// nil without one.
	reshare chan struct{}
	// reserved is how many of slots shareLoop holds (startShare, then
	// shareLoop alone).
	reserved int
	// countPartitions counts the partitions of the consumed topics
	// (partitionCount).
	countPartitions func(context.Context) (int, error)
	// probeSlot lets one probing partition's record run at a time, so that
	// a death is put down to the one record that was running.
	probeSlot chan struct{}

	mu      sync.Mutex
	workers map[tp]*worker
	wg      sync.WaitGroup // live worker goroutines, zombies included

	commitMu sync.Mutex // serializes offset commits with revocation
	crashed  atomic.Bool
	started  time.Time
	// committed: a record of this run has committed (logged once).
	committed atomic.Bool
	// stopBy is the shutdown deadline (unix nanoseconds) once Run is
	// stopping; revocations from then on are bounded by it, so that closing
	// the client never outlives Run by more than a moment.
	stopBy atomic.Int64

	errMu sync.Mutex
	err   error // the first fatal error

	// brokers says whether a broker answered the last check; Run's
	// start-up check was the first.
	brokers brokercheck.State
}

// Run joins the group and processes records until ctx is cancelled. It
// fails at once, with ErrNotMigrated, when a table it uses (the inbox, the
// redrive grants, the partition owners) does not exist in Config.Schema. On
// the way out it finishes in-flight records, commits offsets and leaves the
// group, all bounded by ShutdownTimeout; then it sends the outbox wake-ups
// that the last commits owe (WaitWakeUps). It
// returns nil after a shutdown requested through ctx. Run may be called once.
func (c *Consumer) Run(ctx context.Context) error {
	if !c.started.CompareAndSwap(false, true) {
		return errors.New("consumer: Run called more than once")
	}
	if err := c.checkTables(ctx); err != nil {
		return err
	}
	pollCtx, cancelPoll := context.WithCancel(ctx)
	defer cancelPoll()
	workCtx, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	r := &run{
		c:          c,
		hooks:      testhook.ConsumerFrom(ctx),
		cancelPoll: cancelPoll,
		workCtx:    workCtx,
		workers:    make(map[tp]*worker),
		slots:      make(chan struct{}, c.cfg.Concurrency),
		probeSlot:  make(chan struct{}, 1),
		started:    time.Now(),
	}
	r.startShare() // before the client: a partition may be assigned from then on
	// Last on the way out: the wake-ups that the last commits owe.
	defer c.WaitWakeUps(context.WithoutCancel(ctx))

	opts := []kgo.Opt{
		kgo.SeedBrokers(c.cfg.Brokers...),
		kgo.ConsumerGroup(c.cfg.Group),
		kgo.ConsumeTopics(c.cfg.Topics...),
		kgo.ConsumeStartOffset(startOffset(c.cfg.StartOffset)),
		// A committed offset that fell below the log start resumes at the
		// log start: every record that still exists is processed.
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		// Records of aborted Kafka transactions never reach a handler.
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.DisableAutoCommit(),
		// A resumed partition waits for the fetch in flight to return; a
		// short broker-side wait keeps that pause short.
		kgo.FetchMaxWait(c.cfg.FetchMaxWait),
		kgo.BlockRebalanceOnPoll(),
		kgo.Balancers(kgo.CooperativeStickyBalancer()),
		kgo.SessionTimeout(c.cfg.SessionTimeout),
		// A rebalance (a member joining, or restarting) completes once every
		// member has rejoined, which it does at its next heartbeat: a short
		// interval makes restarts cheap. Three per session at least, so
		// that a short session stays alive.
		kgo.HeartbeatInterval(min(time.Second, c.cfg.SessionTimeout/3)),
		kgo.RebalanceTimeout(c.cfg.RebalanceTimeout),
		kgo.OnPartitionsAssigned(r.onAssigned),
		kgo.OnPartitionsRevoked(r.onRevoked),
		kgo.OnPartitionsLost(r.onLost),
		// No AllowAutoTopicCreation: a typo in a topic name must fail at
		// start-up (checkKafka), not create a topic. The dead-letter
		// produce is idempotent and waits for all ISR acks.
		kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.RecordDeliveryTimeout(c.cfg.DeadLetterTimeout),
	}
	if c.cfg.InstanceID != "" {
		opts = append(opts, kgo.InstanceID(c.cfg.InstanceID))
	}
	opts = append(opts, kgo.ClientID(c.cfg.ClientID))
	cl, err := kgo.NewClient(append(opts, c.cfg.ClientOpts...)...)
	if err != nil {
		return fmt.Errorf("consumer: kafka client: %w", err)
	}
	r.cl = cl
	c.live.Store(r) // NotReady names brokers that do not answer from now on
	if err := r.checkKafka(ctx); err != nil || ctx.Err() != nil {
		cl.Close()
		if err != nil {
			c.cfg.Logger.Error("oncely consumer cannot start", "group", c.cfg.Group, "err", err)
		}
		return err // nil when asked to stop while starting
	}

	shareDone := make(chan struct{})
	if r.reshare != nil {
		go func() {
			defer close(shareDone)
			r.shareLoop(pollCtx)
		}()
	} else {
		close(shareDone)
	}

	committerDone := make(chan struct{})
	committerCtx, stopCommitter := context.WithCancel(workCtx)
	go func() {
		defer close(committerDone)
		r.commitLoop(committerCtx)
	}()
	watcherDone := make(chan struct{})
	go func() {
		defer close(watcherDone)
		brokercheck.Watch(committerCtx, cl, c.cfg.Brokers, brokerCheckInterval, &r.brokers, c.cfg.Logger, "oncely consumer")
	}()

	if reg, err := r.observe(); err == nil {
		defer func() { _ = reg.Unregister() }()
	}
	c.cfg.Logger.Info("oncely consumer started", "group", c.cfg.Group, "topics", c.cfg.Topics, "instance_id", c.cfg.InstanceID,
		"client_id", c.cfg.ClientID)
	c.polling.Store(true)
	for pollCtx.Err() == nil {
		fetches := cl.PollRecords(pollCtx, c.cfg.MaxPollRecords)
		if fetches.IsClientClosed() {
			break
		}
		fetches.EachError(func(topic string, partition int32, err error) {
			if !errors.Is(err, context.Canceled) {
				c.outage.Warn(pollCtx, "oncely fetch error", "topic", topic, "partition", partition, "err", err)
			}
		})
		fetches.EachPartition(func(p kgo.FetchTopicPartition) {
			if len(p.Records) > 0 {
				r.dispatch(p.Topic, p.Partition, p.HighWatermark, p.Records)
			}
		})
		cl.AllowRebalance()
	}
	c.polling.Store(false)
	cancelPoll()
	<-shareDone // the share holds through the drain

	// The periodic committer stops first, so that no commit of its own
	// (waiting on a rebalance, say) holds up the final one.
	deadline := time.Now().Add(c.cfg.ShutdownTimeout)
	r.stopBy.Store(deadline.UnixNano())
	stopCommitter()
	<-committerDone
	<-watcherDone
	r.shutdown(ctx, deadline)
	cancelWork()
	// When Run returns, no transaction of this member is still running,
	// unless a handler ignores cancellation past the shutdown deadline.
	r.waitWorkers(max(time.Until(deadline), time.Second))
	if err := r.fatal(); err != nil {
		c.cfg.Logger.Error("oncely consumer stopped", "err", err)
		return err
	}
	c.cfg.Logger.Info("oncely consumer stopped", "group", c.cfg.Group)
	return nil
}

// firstCommit logs the first record this run committed, once: how long a
// started (or restarted) member takes to do useful work.
func (r *run) firstCommit() {
	if r.committed.CompareAndSwap(false, true) {
		r.c.cfg.Logger.Info("oncely first record committed", "group", r.c.cfg.Group, "since_start", time.Since(r.started))
	}
}

// firstCommit logs the first record the running Kafka member committed.
func (c *Consumer) firstCommit() {
	if r := c.live.Load(); r != nil {
		r.firstCommit()
	}
}

// contended counts n records whose transaction lost to contention.
func (c *Consumer) contended(ctx context.Context, rec *kgo.Record, n int) {
	c.contention.Add(int64(n))
	c.metrics.contention.Add(ctx, int64(n), c.topicAttrs(rec))
	c.lostToContention()
}

// ErrNotMigrated is returned by Run when a table the consumer uses does not
// exist: the inbox, the redrive grants, or the partition_owners table that
// crash-loop detection needs. The error names each missing table.
var ErrNotMigrated = errors.New("consumer: a table of oncely's schema does not exist")

// checkTables fails Run at start-up when a table the consumer uses is
// missing: the inbox (migration 0001), redrive_grants (0007; the claim of
// every record carrying dlq.HeaderRedrive uses it) and, unless
// CrashLoopLimit is -1, partition_owners (0006) with its in_flight (0008)
// and replay_end (0009) columns. The schema was never
// migrated, or not to the latest version, or Config.Schema names another
// schema than the migrations did: the statements on a missing table would
// fail (42P01) on the first record that needs them. The tables are looked
// up by name, not in the migrations' version table, so a schema migrated
// with other tools (goose, atlas, psql) from the same files passes. A
// database that does not answer is not checked here: the record path
// waits for it.
func (c *Consumer) checkTables(ctx context.Context) error {
	cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	// Each requirement is a table, or a column of one (a migration that
	// added a column the consumer writes).
	type need struct{ table, column string }
	needs := []need{{sqlident.Table(c.cfg.Schema, "inbox"), ""}, {sqlident.Table(c.cfg.Schema, "redrive_grants"), ""}}
	if c.crashLoopOn() {
		needs = append(needs, need{c.owners.table, ""}, need{c.owners.table, "in_flight"}, need{c.owners.table, "replay_end"})
	}
	var missing []string
	for _, n := range needs {
		var found bool
		err := c.cfg.Pool.QueryRow(cctx, `SELECT CASE WHEN $2 = '' THEN to_regclass($1) IS NOT NULL
			ELSE EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = $2 AND NOT attisdropped) END`,
			n.table, n.column).Scan(&found)
		if err != nil {
			c.cfg.Logger.Warn("oncely consumer could not check its tables at start-up", "table", n.table, "err", err)
			return nil
		}
		switch {
		case found:
		case n.column == "":
			missing = append(missing, n.table)
		case !slices.Contains(missing, n.table): // a missing table's columns go without saying
			missing = append(missing, n.table+"."+n.column)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%w: %s missing (Config.Schema %q): apply the migrations to that schema first (package migrations, or `oncely migrate up --schema %s`)",
			ErrNotMigrated, strings.Join(missing, ", "), c.cfg.Schema, c.cfg.Schema)
	}
	return nil
}

// fail records the first fatal error and stops the poll loop.
func (r *run) fail(err error) {
	r.errMu.Lock()
	if r.err == nil {
		r.err = err
	}
	r.errMu.Unlock()
	r.cancelPoll()
}

// fatal returns the first fatal error, if any.
func (r *run) fatal() error {
	r.errMu.Lock()
	defer r.errMu.Unlock()
	return r.err
}

// dispatch appends polled records to their partition's worker. It runs on
// the poll goroutine between PollRecords and AllowRebalance, so no
// revocation runs concurrently.
func (r *run) dispatch(topic string, partition int32, hwm int64, recs []*kgo.Record) {
	w := r.worker(tp{topic, partition})
	w.hwm.Store(hwm)
	w.push(recs)
}

// worker returns the partition's worker, starting it if it has none.
func (r *run) worker(key tp) *worker {
	r.mu.Lock()
	defer r.mu.Unlock()
	w := r.workers[key]
	if w == nil {
		w = r.newWorker(key)
		r.workers[key] = w
		r.c.held.Add(1)
		r.resize()
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			w.loop()
		}()
	}
	return w
}

// shutdown drains the workers, commits their offsets and leaves the group.
func (r *run) shutdown(ctx context.Context, deadline time.Time) {
	c := r.c
	bounded, cancel := context.WithDeadline(context.WithoutCancel(ctx), deadline)
	defer cancel()

	ws := r.snapshot()
	if r.crashed.Load() {
		stopWorkers(ws, 0) // a crashed process finishes nothing
	} else {
		stopWorkers(ws, c.cfg.ShutdownTimeout/2)
		if err := r.commit(bounded, ws); err != nil {
			c.cfg.Logger.Warn("oncely final offset commit failed", "err", err)
		}
		r.forget(bounded, ws)
	}
	// Leaving triggers a final onRevoked, which finds its workers stopped
	// and their offsets committed. A member that cannot reach the
	// coordinator in time is not waited for: its session times out.
	r.cl.AllowRebalance()
	if err := r.cl.LeaveGroupContext(bounded); err != nil {
		c.cfg.Logger.Warn("oncely leave group did not finish", "err", err)
	}
	// Close can wait on a request to a broker that stopped answering; the
	// process must not. Past the deadline Run returns and Close finishes
	// (or the process exits) on its own.
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		r.cl.Close()
	}()
	if !waitDone(closed, time.Until(deadline)+time.Second) {
		c.cfg.Logger.Warn("oncely kafka client close is still waiting on a broker; not waiting further")
	}
}

func (r *run) snapshot() []*worker {
	r.mu.Lock()
	defer r.mu.Unlock()
	ws := make([]*worker, 0, len(r.workers))
	for _, w := range r.workers {
		ws = append(ws, w)
	}
	return ws
}

func (r *run) take(parts map[string][]int32) []*worker {
	r.mu.Lock()
	defer r.mu.Unlock()
	var ws []*worker
	for topic, ps := range parts {
		for _, p := range ps {
			if w := r.workers[tp{topic, p}]; w != nil {
				ws = append(ws, w)
			}
		}
	}
	return ws
}

func (r *run) remove(ws []*worker) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, w := range ws {
		if r.workers[w.tp] == w {
			delete(r.workers, w.tp)
			r.c.held.Add(-1)
			r.resize()
		}
		w.leave()
	}
}

// revokeCommitTimeout bounds the offset commit of revoked partitions.
const revokeCommitTimeout = 5 * time.Second

// onRevoked runs when partitions move away in a rebalance (and when leaving):
// their workers finish or abandon the in-flight record, what committed is
// committed to Kafka, and only then does the rebalance proceed.
func (r *run) onRevoked(ctx context.Context, cl *kgo.Client, revoked map[string][]int32) {
	ws := r.take(revoked)
	if len(ws) > 0 {
		limit := time.Now().Add(r.c.cfg.RevokeTimeout)
		if by := r.stopBy.Load(); by != 0 && by < limit.UnixNano() {
			limit = time.Unix(0, by)
		}
		stopWorkers(ws, time.Until(limit))
		// The commit has a bound of its own: a worker that used all of
		// RevokeTimeout must not leave the others' finished records
		// uncommitted, for the next owner to process again.
		commitBy := time.Now().Add(revokeCommitTimeout)
		if by := r.stopBy.Load(); by != 0 && by < commitBy.UnixNano() {
			commitBy = time.Unix(0, max(by, time.Now().Add(time.Second).UnixNano()))
		}
		cctx, cancel := context.WithDeadline(ctx, commitBy)
		// The workers leave in the same hold of commitMu: no periodic
		// commit of an older snapshot can come between this commit and
		// the next owner's.
		r.commitMu.Lock()
		if err := r.commitLocked(cctx, ws); err != nil {
			r.c.cfg.Logger.Warn("oncely commit on revoke failed", "err", err)
		}
		for _, w := range ws {
			w.leave()
		}
		r.commitMu.Unlock()
		cancel()
		r.forget(ctx, ws)
		r.remove(ws)
	}
	cl.ResumeFetchPartitions(revoked) // a partition that comes back must not stay paused
	if len(revoked) > 0 {
		r.c.cfg.Logger.Info("oncely partitions revoked", "partitions", revoked)
	}
}

// onAssigned starts a worker for each partition the member gained, records
// or not: the worker takes the partition's partition_owners row (see
// startOwnership), so that the member's clean exit deletes it even when the
// partition never had a record to process. A partition assigned while
// stopping is left by the final onRevoked like any other.
func (r *run) onAssigned(_ context.Context, _ *kgo.Client, assigned map[string][]int32) {
	for topic, ps := range assigned {
		for _, p := range ps {
			r.worker(tp{topic, p})
		}
	}
	if len(assigned) > 0 {
		r.c.cfg.Logger.Info("oncely partitions assigned", "partitions", assigned)
	}
}

// onLost runs when the member lost its partitions without a clean revoke
// (session expired, fenced): another member may already own them, so the
// in-flight records are abandoned and nothing is committed.
func (r *run) onLost(_ context.Context, cl *kgo.Client, lost map[string][]int32) {
	ws := r.take(lost)
	// Another member may own them already: from now on no commit of ours
	// includes them.
	r.commitMu.Lock()
	for _, w := range ws {
		w.leave()
	}
	r.commitMu.Unlock()
	stopWorkers(ws, 0)
	// Not a death: the process lives on. A next owner that wrote the row
	// first counted it as one all the same (see forget).
	r.forget(context.Background(), ws)
	r.remove(ws)
	cl.ResumeFetchPartitions(lost)
	r.c.cfg.Logger.Warn("oncely partitions lost", "partitions", lost)
}

// commitLoop commits marked offsets every CommitInterval.
func (r *run) commitLoop(ctx context.Context) {
	every(ctx, r.c.cfg.CommitInterval, func() {
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if err := r.commit(cctx, r.snapshot()); err != nil && ctx.Err() == nil {
			r.c.outage.Warn(ctx, "oncely offset commit failed; retrying next interval", "err", err)
		}
	})
}

// every runs f every d until ctx ends.
func every(ctx context.Context, d time.Duration, f func()) {
	t := time.NewTicker(d)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			f()
		}
	}
}

// commit synchronously commits the marked offsets of ws that are ahead of
// what was committed. A crashed run commits nothing.
func (r *run) commit(ctx context.Context, ws []*worker) error {
	r.commitMu.Lock()
	defer r.commitMu.Unlock()
	return r.commitLocked(ctx, ws)
}

// commitLocked is commit with commitMu held.
func (r *run) commitLocked(ctx context.Context, ws []*worker) error {
	if r.crashed.Load() {
		return nil
	}
	offsets := make(map[string]map[int32]kgo.EpochOffset)
	pending := make(map[*worker]int64)
	for _, w := range ws {
		eo, ok := w.dirtyMark()
		if !ok {
			continue
		}
		if offsets[w.tp.topic] == nil {
			offsets[w.tp.topic] = make(map[int32]kgo.EpochOffset)
		}
		offsets[w.tp.topic][w.tp.partition] = eo
		pending[w] = eo.Offset
	}
	if len(offsets) == 0 {
		return nil
	}
	var cerr error
	r.cl.CommitOffsetsSync(ctx, offsets, func(_ *kgo.Client, _ *kmsg.OffsetCommitRequest, resp *kmsg.OffsetCommitResponse, err error) {
		if err != nil {
			cerr = err
			return
		}
		for _, t := range resp.Topics {
			for _, p := range t.Partitions {
				if err := kerr.ErrorForCode(p.ErrorCode); err != nil && cerr == nil {
					cerr = fmt.Errorf("%s/%d: %w", t.Topic, p.Partition, err)
				}
			}
		}
	})
	if cerr != nil {
		return fmt.Errorf("consumer: commit offsets: %w", cerr)
	}
	r.c.commits.Add(1)
	for w, off := range pending {
		w.committed(off)
	}
	return nil
}

// waitWorkers waits up to d for worker goroutines; a handler that ignores
// its context may outlive Run, and it can no longer commit offsets.
func (r *run) waitWorkers(d time.Duration) {
	done := make(chan struct{})
	go func() { r.wg.Wait(); close(done) }()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		r.c.cfg.Logger.Warn("oncely consumer: a handler ignored cancellation and is still running")
	}
}

// worker processes one partition's records in order.
type worker struct {
	r  *run
	tp tp

	owner     string      // this ownership of the partition (partition_owners)
	forgotten atomic.Bool // its partition_owners row was deleted: it left cleanly

	ctx     context.Context    // cancelled to abandon the in-flight record
	abandon context.CancelFunc //
	stop    chan struct{}      // closed: finish the in-flight attempt, start nothing new
	stopped sync.Once
	done    chan struct{}
	wake    chan struct{}

	hwm atomic.Int64 // partition high watermark seen in the last fetch

	replaying *keyReplay // a replay for loopKeys to run (set by the probe, before loopKeys starts)

	mu     sync.Mutex
	queue  []*kgo.Record
	full   bool   // the buffer reached MaxBufferedRecords and has not drained to half
	dbHold bool   // the last transaction attempt could not reach the database
	dlqErr string // the last dead-letter write failed: why ("" once one succeeded)
	gone   bool   // revoked, lost or stopped: see leave
	// since is when the worker began on the record at offset at, the
	// first it has not finished; zero while it has nothing to do.
	since      time.Time
	at         int64
	paused     bool            // fetching is paused: full or dbHold
	mark       kgo.EpochOffset // next offset to commit
	hasMark    bool
	lastCommit int64
}

func (r *run) newWorker(key tp) *worker {
	ctx, cancel := context.WithCancel(r.workCtx)
	owner := ""
	if r.c.crashLoopOn() {
		owner = newOwnerToken()
	}
	return &worker{
		r: r, tp: key, ctx: ctx, abandon: cancel, owner: owner,
		stop: make(chan struct{}), done: make(chan struct{}), wake: make(chan struct{}, 1),
		lastCommit: -1,
	}
}

// push appends records and pauses fetching the partition when its buffer is
// full; the worker resumes it once the buffer has drained to half.
func (w *worker) push(recs []*kgo.Record) {
	w.mu.Lock()
	w.queue = append(w.queue, recs...)
	if len(w.queue) >= w.r.c.cfg.MaxBufferedRecords {
		w.full = true
		w.syncPause()
	}
	w.mu.Unlock()
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// syncPause pauses or resumes fetching the partition to match full and
// dbHold. w.mu must be held.
func (w *worker) syncPause() {
	want := w.full || w.dbHold
	if want == w.paused {
		return
	}
	w.paused = want
	parts := map[string][]int32{w.tp.topic: {w.tp.partition}}
	if want {
		w.r.cl.PauseFetchPartitions(parts)
	} else {
		w.r.cl.ResumeFetchPartitions(parts)
	}
}

// databaseDown records whether the database answered the worker's last
// transaction attempt: while it does not, the partition fetches nothing
// more (the group membership stays; heartbeats go on).
func (w *worker) databaseDown(down bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.dbHold != down && !w.gone {
		w.dbHold = down
		w.syncPause()
	}
}

// deadLetterDown records whether the worker's last dead-letter write
// failed, and why.
func (w *worker) deadLetterDown(why string) {
	w.mu.Lock()
	w.dlqErr = why
	w.mu.Unlock()
}

// unready says why the partition keeps its member from being ready, or
// "": it waits for the database, for its dead-letter topic, or has been on
// one record for longer than StuckAfter. A worker that left counts no more.
func (w *worker) unready(now time.Time) string {
	w.mu.Lock()
	defer w.mu.Unlock()
	where := fmt.Sprintf("%s/%d", w.tp.topic, w.tp.partition)
	switch {
	case w.gone:
		return ""
	case w.dbHold:
		return "partition " + where + " waits for the database"
	case w.dlqErr != "":
		return "partition " + where + " waits for its dead-letter topic: " + w.dlqErr
	case !w.since.IsZero() && now.Sub(w.since) > w.r.c.cfg.StuckAfter:
		return fmt.Sprintf("partition %s stuck on offset %d for %s (StuckAfter %s)", where, w.at,
			now.Sub(w.since).Truncate(time.Second), w.r.c.cfg.StuckAfter)
	}
	return ""
}

// idle records that the worker has no record at hand.
func (w *worker) idle() {
	w.mu.Lock()
	w.since = time.Time{}
	w.mu.Unlock()
}

// leave marks w as no longer the owner of its partition: it counts no more
// toward Ready, and no periodic commit commits its offsets (the next owner
// commits that partition now; a stale mark of ours would move it back).
// Call it with commitMu held, so that no commit in progress includes w.
func (w *worker) leave() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.gone = true
}

func (w *worker) next() (*kgo.Record, bool) {
	for {
		select {
		case <-w.stop:
			return nil, false
		default:
		}
		if rec, ok := w.pop(); ok {
			return rec, true
		}
		w.idle()
		select {
		case <-w.stop:
			return nil, false
		case <-w.wake:
		}
	}
}

func (w *worker) loop() {
	defer close(w.done)
	if !w.startOwnership() {
		return
	}
	switch cfg := &w.r.c.cfg; {
	case cfg.KeyParallelism > 1:
		w.loopKeys(cfg.KeyParallelism)
	case cfg.BatchSize > 1:
		w.loopBatches(cfg.BatchSize)
	default:
		w.loopRecords()
	}
}

// loopRecords processes the partition's records one after another, each in
// its own transaction.
func (w *worker) loopRecords() {
	for {
		rec, ok := w.next()
		if !ok {
			return
		}
		w.r.c.metrics.consumed.Add(w.ctx, 1, w.r.c.topicAttrs(rec))
		w.r.c.checkID(w.ctx, rec)
		if !w.process(rec) {
			return
		}
		w.markDone(rec)
	}
}

// markDone marks the offset after rec: every record up to rec is finished.
func (w *worker) markDone(rec *kgo.Record) {
	w.mu.Lock()
	w.mark = kgo.EpochOffset{Epoch: rec.LeaderEpoch, Offset: rec.Offset + 1}
	w.hasMark = true
	w.since, w.at = time.Now(), rec.Offset+1 // on to the next record, if any
	w.mu.Unlock()
}

// acquire takes a transaction slot (Config.Concurrency); it gives up (false)
// when the worker is stopped or abandoned first.
func (w *worker) acquire() bool {
	select {
	case w.r.slots <- struct{}{}:
		return true
	case <-w.stop:
		return false
	case <-w.ctx.Done():
		return false
	}
}

func (w *worker) release() { <-w.r.slots }

func (w *worker) dirtyMark() (kgo.EpochOffset, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.mark, w.hasMark && w.mark.Offset > w.lastCommit && !w.gone
}

func (w *worker) committed(off int64) {
	w.mu.Lock()
	w.lastCommit = max(w.lastCommit, off)
	w.mu.Unlock()
}

// stopWorkers asks ws to stop after their in-flight attempt and waits up to
// grace; workers still running then are abandoned (their transactions roll
// back) and waited for a short while more.
func stopWorkers(ws []*worker, grace time.Duration) {
	for _, w := range ws {
		w.stopped.Do(func() { close(w.stop) })
	}
	deadline := time.Now().Add(grace)
	for _, w := range ws {
		if !waitDone(w.done, time.Until(deadline)) {
			w.abandon()
		}
	}
	deadline = time.Now().Add(time.Second)
	for _, w := range ws {
		w.abandon()
		waitDone(w.done, time.Until(deadline))
	}
}

func waitDone(done <-chan struct{}, d time.Duration) bool {
	if d <= 0 {
		select {
		case <-done:
			return true
		default:
			return false
		}
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-done:
		return true
	case <-t.C:
		return false
	}
}

// process runs attempts for rec until one succeeds or the record is
// dead-lettered (true), or the worker is stopped or abandoned (false).
func (w *worker) process(rec *kgo.Record) bool {
	c := w.r.c
	if c.oversized(rec) {
		size, now := recordSize(rec), time.Now()
		id, err := c.messageID(rec)
		if err != nil {
			id = c.fallbackID(rec)
		}
		return w.deadLetter(rec, id, failure{
			class: dlq.ClassOversized, first: now, last: now,
			err: fmt.Errorf("record of %d bytes exceeds MaxRecordBytes %d", size, c.cfg.MaxRecordBytes),
		})
	}
	return w.retry(rec, nil)
}

// retry runs attempts for rec as process does. prior, when not nil, is an
// attempt already made and failed (in a batch transaction); it counts.
func (w *worker) retry(rec *kgo.Record, prior *result) bool {
	return w.r.c.deliver(w.ctx, rec, kafkaSource{w}, prior)
}

// A Source is what the record path needs from a broker, and all that
// differs between brokers: how a failed record comes back, how a finished
// one is acknowledged, how a dead-letter copy is written, and what the
// broker counts of a record's deliveries. The Kafka partition worker is one
// (kafkaSource, below); package natsconsumer's JetStream message and
// package rabbitconsumer's AMQP delivery are others. Everything else (the transaction, the inbox claim, the handler,
// the classification of a failure, the backoff, the decision to
// dead-letter, the spans and metrics) is the record path's own: deliver.
type Source interface {
	// Spent is how many attempts the broker has counted for the record
	// before this delivery: 0 where the consumer counts its own (Kafka),
	// the delivery count less one where the broker counts redeliveries
	// (JetStream), so that attempts lost to a crash count too.
	Spent() int
	// Pause waits d before the record runs again in this process (after
	// contention, or while the database is unreachable: neither spends
	// an attempt). It reports false when the source stops first.
	Pause(d time.Duration) bool
	// Retry is called after a failed attempt that spent an attempt and
	// is not dead-lettered. It waits delay and reports true for the
	// record to run again here (Kafka), or hands the record back to the
	// broker for redelivery after delay and reports false (JetStream's
	// NakWithDelay).
	Retry(ctx context.Context, delay time.Duration) bool
	// DatabaseDown says whether the database answered the last attempt.
	DatabaseDown(down bool)
	// PublishDeadLetter writes the dead-letter copy of rec, described by
	// info, and returns once the broker confirmed it durable (all in-sync
	// replicas' acks; JetStream's PubAck). It retries failures itself and
	// reports false only when ctx ends or the source stops first. ctx
	// carries the dead-letter "send" span: inject it into the copy.
	PublishDeadLetter(ctx context.Context, rec *kgo.Record, info *dlq.Info) bool
	// Settle acknowledges the record once its transaction committed (or it
	// was a duplicate), or, with deadLettered, once its dead-letter copy
	// is confirmed and recorded in the inbox. It reports false when the
	// source stops there (a test's crash point).
	Settle(ctx context.Context, rec *kgo.Record, deadLettered bool) bool
}

// deliver is the record path: it runs attempts for rec, each one
// transaction (attempt), until one commits or the id is a duplicate
// (Settle), or the failure dead-letters it (deadLetter); a contended
// attempt or one that found the database unreachable runs again
// (src.Pause) without spending an attempt; any other failure spends one and
// retries after a backoff (src.Retry). It reports whether rec is finished
// here: false when src stopped first, or handed rec back to the broker.
// prior, when not nil, is an attempt already made and failed (in a batch
// transaction); it counts.
func (c *Consumer) deliver(ctx context.Context, rec *kgo.Record, src Source, prior *result) bool {
	var f failure
	f.attempts = src.Spent()
	if prior == nil && f.attempts >= c.cfg.MaxAttempts {
		return c.deliveredOut(ctx, rec, src, f)
	}
	contended := 0
	for n := 1; ; n++ {
		var res result
		if n == 1 && prior != nil {
			res = *prior
		} else {
			res = c.attempt(ctx, rec, f.attempts+1, src)
		}
		switch {
		case res.stopped:
			return false
		case res.err == nil:
			src.DatabaseDown(false)
			if res.duplicate {
				c.countDuplicate(ctx, rec)
			} else {
				c.processed.Add(1)
				c.firstCommit()
			}
			return src.Settle(ctx, rec, false)
		case ctx.Err() != nil:
			return false // abandoned: the transaction rolled back
		case res.contention:
			// Lost to another transaction: not the record's fault. Again,
			// soon, attempts unspent.
			src.DatabaseDown(false)
			contended++
			c.contended(ctx, rec, 1)
			if !src.Pause(contentionBackoff.Delay(contended)) {
				return false
			}
			continue
		case res.infra:
			src.DatabaseDown(true)
		default:
			src.DatabaseDown(false)
			f.fail(res)
			if class, ok := deadLetterClass(res.err, f.attempts, c.cfg.MaxAttempts); ok {
				f.class = class
				return c.deadLetter(ctx, rec, res.id, f, src, isRedrive(rec))
			}
		}
		c.retries.Add(1)
		c.metrics.retries.Add(ctx, 1, c.topicAttrs(rec))
		delay := c.backoff.Delay(n + src.Spent())
		args := []any{"topic", rec.Topic, "partition", rec.Partition,
			"offset", rec.Offset, "message_id", res.id, "attempt", n + src.Spent(), "database", res.infra, "delay", delay, "err", res.err}
		if res.infra {
			// The database is unreachable: every partition's records fail
			// alike until it is back. It spends no attempt: the record
			// waits here, whatever the broker does.
			c.outage.Warn(ctx, "oncely attempt failed on the database; retrying", args...)
			if !src.Pause(delay) {
				return false
			}
			continue
		}
		c.cfg.Logger.Warn("oncely attempt failed; retrying", args...)
		if !src.Retry(ctx, delay) {
			return false
		}
	}
}

// NewRecordPath returns a Consumer that joins no Kafka group: only the
// record path, for a broker adapter (natsconsumer, rabbitconsumer) that fetches
// messages itself and hands each to Deliver with its Source. system is the
// broker's messaging.system ("nats"). A message is given as a *kgo.Record:
// Topic the name it was published to, Offset its sequence in the broker,
// Headers its headers (the trace context among them), Timestamp when it was
// stored. Of cfg, the Kafka group's fields (Brokers, Topics, ClientOpts,
// offsets, BatchMaxWait, key modes, Concurrency, GroupConcurrency) are not used; BatchHandler
// (with BatchSize above 1), BatchLockTimeout and ConflictKeys apply to
// DeliverBatch's transactions; DeadLetterTopic
// names a message's dead-letter destination in spans and logs; crash-loop
// detection is off (CrashLoopLimit -1): the broker's delivery count, through
// Source.Spent, stands for it. The outbox wake-ups that its transactions
// owe are sent after their commits (see WaitWakeUps, for the adapter's
// stop).
func NewRecordPath(cfg Config, system string) (*Consumer, error) {
	if system == "" {
		return nil, fmt.Errorf("%w: system: a messaging.system name is required", ErrInvalidConfig)
	}
	cfg.system = system
	cfg.CrashLoopLimit = -1
	return New(cfg)
}

// Deliver runs rec through the record path with src (see Source and
// NewRecordPath): one transaction per attempt whose first statement claims
// the message id; the handler runs only for a new claim; src settles rec
// only after COMMIT, or after its dead-letter copy was confirmed and
// recorded. It reports whether rec was settled here: false when ctx ended,
// or src stopped or handed it back to the broker for redelivery. Call it
// for one message at a time per goroutine; messages may run concurrently.
func (c *Consumer) Deliver(ctx context.Context, rec *kgo.Record, src Source) bool {
	c.metrics.consumed.Add(ctx, 1, c.topicAttrs(rec))
	c.checkID(ctx, rec)
	return c.deliver(ctx, rec, src, nil)
}

// DeliverBatch runs recs, each with its Source in srcs, through the record
// path's batch mode (see Config.BatchSize): one transaction whose first
// statement claims all of their ids with one multi-row insert; each new
// message's Handler under a savepoint of its own (or the BatchHandler once
// for them all); COMMIT; then each message is settled by its Source. A
// message whose handler failed is rolled back to its savepoint alone, and
// once the others committed it goes on to the record path (Deliver) with
// that failure counted as an attempt: it is retried, handed back to the
// broker or dead-lettered there. A batch that fails as a whole runs each of
// its messages alone. Messages that cannot share a batch (an undecodable
// id, a redrive) run alone in their place. The messages keep no order: a
// failed one holds back no other. It reports whether every message was
// settled here: false when ctx ended, or a Source stopped or handed its
// message back to the broker.
func (c *Consumer) DeliverBatch(ctx context.Context, recs []*kgo.Record, srcs []Source) bool {
	if len(recs) != len(srcs) {
		panic(fmt.Sprintf("consumer: DeliverBatch: %d records and %d sources", len(recs), len(srcs)))
	}
	if len(recs) == 0 {
		return true
	}
	for _, rec := range recs {
		c.metrics.consumed.Add(ctx, 1, c.topicAttrs(rec))
		c.checkID(ctx, rec)
	}
	p := &batchPath{ctx: ctx, unordered: true, alone: func(rec *kgo.Record, src Source) bool {
		return c.deliver(ctx, rec, src, nil)
	}}
	return c.processBatch(p, recs, srcs)
}

// spanAttrsKey carries WithSpanAttributes's attributes.
type spanAttrsKey struct{}

// WithSpanAttributes returns ctx carrying kv: the process spans of a
// message given to Deliver with it carry them too. A broker adapter passes
// its messaging system's own semantic-convention attributes this way
// (RabbitMQ's routing key and delivery tag).
func WithSpanAttributes(ctx context.Context, kv ...attribute.KeyValue) context.Context {
	return context.WithValue(ctx, spanAttrsKey{}, kv)
}

// CheckSchema is Run's start-up check, for a Consumer of NewRecordPath: it
// fails with ErrNotMigrated naming each table of the record path (the inbox,
// the redrive grants) that does not exist in Config.Schema.
func (c *Consumer) CheckSchema(ctx context.Context) error { return c.checkTables(ctx) }

// countDuplicate counts rec as a duplicate: its id had finished (processed,
// or dead-lettered) before this delivery, so no handler ran for it.
func (c *Consumer) countDuplicate(ctx context.Context, rec *kgo.Record) {
	c.duplicates.Add(1)
	c.metrics.duplicates.Add(ctx, 1, c.topicAttrs(rec))
}

// deliveredOut settles a record that the broker delivered MaxAttempts
// times already (Source.Spent) without any attempt settling it: each one
// ended with its process, or its connection, before a verdict (a crash
// loop), or only the acknowledgement of a finished one was lost. The inbox
// tells which: a processed id is a duplicate, a dead-lettered one was
// dead-lettered before; else it is dead-lettered as a crash loop without
// running again.
func (c *Consumer) deliveredOut(ctx context.Context, rec *kgo.Record, src Source, f failure) bool {
	id, err := c.messageID(rec)
	if err != nil {
		id = c.fallbackID(rec)
	}
	var o dedup.Outcome
	found := false
	if !c.untilDatabase(ctx, src, func() error {
		var err error
		o, err = c.inbox.Lookup(ctx, c.cfg.Pool, c.cfg.Group, id)
		found = err == nil
		if err != nil && !errors.Is(err, dedup.ErrNotClaimed) && !databaseFailed(err) && !isContention(err) {
			// Not an outage: waiting would not end it. Not found, as far
			// as anyone can tell: dead-lettered (a row present keeps it).
			c.outage.Log(ctx, slog.LevelError, "oncely dead-letter lookup failed",
				"oncely inbox lookup of a record delivered out failed", "topic", rec.Topic,
				"offset", rec.Offset, "message_id", id, "err", err)
			return nil
		}
		if errors.Is(err, dedup.ErrNotClaimed) {
			return nil
		}
		return err
	}) {
		return false
	}
	if found {
		c.countDuplicate(ctx, rec)
		return src.Settle(ctx, rec, o == dedup.DeadLettered)
	}
	now := time.Now()
	f.class, f.first, f.last = dlq.ClassCrashLoop, now, now
	f.err = fmt.Errorf("consumer: delivered %d times and no attempt finished (MaxAttempts %d): the process or its connection died while running it",
		f.attempts, c.cfg.MaxAttempts)
	c.crashLoops.Add(1)
	return c.deadLetter(ctx, rec, id, f, src, isRedrive(rec))
}

// DeadLetterRecord returns the dead-letter copy of rec that info describes,
// for a Source's PublishDeadLetter: topic DeadLetterTopic(rec.Topic), rec's
// key and value, the original headers that DeadLetterHeaders keeps, the
// message-id header, info's oncely-dlq-* headers, the producer's
// traceparent in dlq.HeaderOriginalTraceParent, and the trace context of
// ctx (the dead-letter send span) as traceparent and tracestate.
func (c *Consumer) DeadLetterRecord(ctx context.Context, rec *kgo.Record, info *dlq.Info) *kgo.Record {
	out := dlq.NewRecord(c.cfg.DeadLetterTopic(rec.Topic), rec, info, c.cfg.DeadLetterHeaders)
	// The copy continues from the send span; the producer's own context
	// stays in HeaderOriginalTraceParent.
	if tp := (telemetry.Carrier{Headers: &rec.Headers}).Get("traceparent"); tp != "" {
		out.Headers = append(out.Headers, kgo.RecordHeader{Key: dlq.HeaderOriginalTraceParent, Value: []byte(tp)})
	}
	telemetry.Inject(ctx, &out.Headers)
	return out
}

// slotter is a Source whose attempts take a transaction slot
// (Config.Concurrency) of the run.
type slotter interface {
	acquire() bool
	release()
}

// failure accumulates what a dead-letter record says about the failures.
type failure struct {
	class       dlq.Class
	attempts    int
	first, last time.Time
	err         error
	span        trace.SpanContext // the last attempt's span
	traceparent string
	tracestate  string
}

func (f *failure) fail(res result) {
	now := time.Now()
	if f.first.IsZero() {
		f.first = now
	}
	f.last, f.err, f.span = now, res.err, res.spanContext
	// The W3C form, for the dead-letter record, is built only for failures.
	f.traceparent, f.tracestate = telemetry.TraceContext(trace.ContextWithSpanContext(context.Background(), res.spanContext))
	f.attempts++
}

// deadLetter has src write rec's dead-letter copy and wait for the broker's
// confirmation, records the id as dead-lettered in the inbox, and only then
// settles rec (marks the Kafka offset; terminates the JetStream message).
// Meanwhile the record waits. redrive says whether the inbox row may use up
// a redrive grant (matched by the record's dlq.HeaderRedrive ref). It
// returns false if ctx ended or src stopped first: rec is not settled and
// is delivered again.
func (c *Consumer) deadLetter(ctx context.Context, rec *kgo.Record, id string, f failure, src Source, redrive bool) bool {
	info := &dlq.Info{
		Topic: rec.Topic, Partition: rec.Partition, Offset: rec.Offset, Timestamp: rec.Timestamp,
		Group: c.cfg.Group, MessageID: id, Attempts: f.attempts, FirstFailure: f.first, LastFailure: f.last,
		Class: f.class, Error: f.err.Error(), TraceParent: f.traceparent, TraceState: f.tracestate,
	}
	topic := c.cfg.DeadLetterTopic(rec.Topic)
	sendCtx, span := c.startSendSpan(ctx, topic, f.span, id)
	span.SetAttributes(telemetry.DLQClass.String(string(f.class)))
	published := src.PublishDeadLetter(sendCtx, rec, info)
	span.End()
	if !published {
		return false
	}
	ref, _ := redriveRef(rec)
	entry := dedup.Entry{Group: c.cfg.Group, MessageID: id, Topic: rec.Topic, Partition: rec.Partition,
		Offset: rec.Offset, Outcome: dedup.DeadLettered, Redrive: redrive, RedriveRef: ref}
	if !c.recordDeadLettered(ctx, rec, entry, src) {
		return false
	}
	c.deadLettered.Add(1)
	c.metrics.deadLettered.Add(ctx, 1, metric.WithAttributes(c.system,
		telemetry.MessagingConsumerGroup.String(c.cfg.Group), telemetry.MessagingDestination.String(rec.Topic),
		telemetry.DLQClass.String(string(f.class))))
	c.cfg.Logger.Warn("oncely record dead-lettered", "topic", rec.Topic, "partition", rec.Partition,
		"offset", rec.Offset, "message_id", id, "class", f.class, "attempts", f.attempts, "dlq_topic", topic, "err", f.err)
	return src.Settle(ctx, rec, true)
}

// untilDatabase runs stmt until the database answers it, waiting with
// backoff meanwhile (the record waits). It reports false when ctx ended or
// src stopped first.
func (c *Consumer) untilDatabase(ctx context.Context, src Source, stmt func() error) bool {
	for n := 1; ; n++ {
		err := stmt()
		if err == nil {
			src.DatabaseDown(false)
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		src.DatabaseDown(true)
		if !src.Pause(c.backoff.Delay(n)) {
			return false
		}
	}
}

// kafkaSource is the Kafka partition worker as a Source: a failed record
// runs again in the worker after its backoff, a finished one's offset is
// marked by the worker's loop, and a dead-letter copy is produced to the
// dead-letter topic with all in-sync replicas' acks.
type kafkaSource struct{ w *worker }

func (s kafkaSource) Spent() int                                    { return 0 }
func (s kafkaSource) Pause(d time.Duration) bool                    { return s.w.sleep(d) }
func (s kafkaSource) Retry(_ context.Context, d time.Duration) bool { return s.w.sleep(d) }
func (s kafkaSource) DatabaseDown(down bool)                        { s.w.databaseDown(down) }
func (s kafkaSource) acquire() bool                                 { return s.w.acquire() }
func (s kafkaSource) release()                                      { s.w.release() }

// Settle runs the crash-point hook; the caller marks the offset.
func (s kafkaSource) Settle(_ context.Context, rec *kgo.Record, deadLettered bool) bool {
	if deadLettered {
		return s.w.hook(s.w.r.hooks.AfterDeadLetter, rec)
	}
	return s.w.hook(s.w.r.hooks.AfterCommit, rec)
}

// deadLetter dead-letters rec from the partition worker. An oversized
// record was never claimed: a redelivery of one already dead-lettered (or
// processed) is recognised here, unless an operator redrove it.
func (w *worker) deadLetter(rec *kgo.Record, id string, f failure) bool {
	c := w.r.c
	ref, redrive := redriveRef(rec)
	if f.class == dlq.ClassOversized { // never claimed: check for a redelivery here
		for n := 1; ; n++ {
			o, err := c.inbox.Lookup(w.ctx, c.cfg.Pool, c.cfg.Group, id)
			if err == nil && o == dedup.DeadLettered && redrive {
				// Dead-lettered again only when an operator redrove it:
				// the header alone is anybody's to write.
				redrive, err = c.inbox.RedriveGranted(w.ctx, c.cfg.Pool, c.cfg.Group, id, ref)
			}
			if err == nil && (o == dedup.Processed || !redrive) {
				c.countDuplicate(w.ctx, rec)
				return w.hook(w.r.hooks.AfterCommit, rec)
			}
			if err == nil || errors.Is(err, dedup.ErrNotClaimed) {
				break
			}
			if w.ctx.Err() != nil {
				return false
			}
			if !databaseFailed(err) && !isContention(err) {
				// Not an outage: waiting would not end it. Without a grant
				// confirmed, a redrive header counts for nothing: an id
				// dead-lettered before is a duplicate, and an id not found
				// is dead-lettered.
				c.outage.Log(w.ctx, slog.LevelError, "oncely dead-letter lookup failed",
					"oncely inbox lookup of an oversized record failed", "topic", rec.Topic,
					"partition", rec.Partition, "offset", rec.Offset, "message_id", id, "err", err)
				if o == dedup.DeadLettered {
					c.countDuplicate(w.ctx, rec)
					return w.hook(w.r.hooks.AfterCommit, rec)
				}
				redrive = false
				break
			}
			w.databaseDown(databaseFailed(err))
			if !w.sleep(c.backoff.Delay(n)) {
				return false
			}
		}
	}
	return c.deadLetter(w.ctx, rec, id, f, kafkaSource{w}, redrive)
}

// PublishDeadLetter produces rec's dead-letter copy and waits for the acks
// of all in-sync replicas, retrying with backoff while the partition waits.
func (s kafkaSource) PublishDeadLetter(sendCtx context.Context, rec *kgo.Record, info *dlq.Info) bool {
	w := s.w
	c := w.r.c
	topic := c.cfg.DeadLetterTopic(rec.Topic)
	span := trace.SpanFromContext(sendCtx)
	stub, tooLarge := false, 0
	for n := 1; ; n++ {
		out := c.DeadLetterRecord(sendCtx, rec, info) // a fresh record per produce
		if stub {
			out = dlq.Stub(out, c.cfg.MessageIDHeader)
		}
		ctx, cancel := context.WithTimeout(w.ctx, c.cfg.DeadLetterTimeout)
		err := w.r.cl.ProduceSync(ctx, out).FirstErr()
		cancel()
		if err == nil {
			c.metrics.sent.Add(w.ctx, 1, metric.WithAttributes(telemetry.Kafka, telemetry.MessagingDestination.String(topic)))
			w.deadLetterDown("")
			return true
		}
		c.metrics.sent.Add(w.ctx, 1, metric.WithAttributes(telemetry.Kafka, telemetry.MessagingDestination.String(topic),
			telemetry.ErrorType.String("produce")))
		if w.ctx.Err() != nil {
			telemetry.Fail(span, err, "produce")
			return false
		}
		c.deadLetterErrs.Add(1)
		if !stub && (errors.Is(err, kerr.MessageTooLarge) || errors.Is(err, kerr.RecordListTooLarge)) {
			// The broker refuses a whole batch: the copy may have shared it
			// with another partition's copy that is too large. A copy that
			// fits the topic goes again, a few times at most; one that
			// does not (or whose topic's limit the brokers do not tell)
			// will not fit later either: a stub goes instead, at once.
			if tooLarge < maxTooLargeRetries && fitsTopic(w.ctx, w.r.cl, topic, out, c.cfg.DeadLetterTimeout) {
				tooLarge++
				c.cfg.Logger.Warn("oncely dead-letter batch refused as too large, though this record fits its topic; producing it again",
					"topic", rec.Topic, "partition", rec.Partition, "offset", rec.Offset, "dlq_topic", topic, "err", err)
				continue
			}
			stub = true
			c.cfg.Logger.Warn("oncely dead-letter record too large; writing a stub without its value", "topic", rec.Topic,
				"partition", rec.Partition, "offset", rec.Offset, "dlq_topic", topic, "err", err)
			continue
		}
		w.deadLetterDown(fmt.Sprintf("%s cannot be written: %v", topic, err))
		delay := c.backoff.Delay(n)
		msg := "oncely dead-letter produce failed; partition waits"
		c.outage.Log(w.ctx, slog.LevelError, msg, msg, "topic", rec.Topic,
			"partition", rec.Partition, "offset", rec.Offset, "dlq_topic", topic, "delay", delay, "err", err)
		if !w.sleep(delay) {
			return false
		}
	}
}

// deadLetterRowAttempts bounds the attempts at a dead-lettered record's
// inbox row that fail for another reason than the database being away.
const deadLetterRowAttempts = 5

// recordDeadLettered writes the inbox row of a record whose dead-letter
// copy is durable. An id already present (dead-lettered before a redrive,
// or processed by a zombie meanwhile) keeps its row: DO NOTHING. A
// redriven record uses up its redrive grant here: it had its run.
//
// While the database is unreachable, or the statement loses to
// contention, it waits without limit: the partition waits for the
// database. Any other error (a missing table, say) would not end by
// waiting. It is logged; a redriven record's claim falls back to an
// ordinary one (the grant is left, as when a redrive's produce fails); and
// after deadLetterRowAttempts such failures the record goes without its
// row, which only costs a later redelivery of the id one more run and
// dead-letter copy: its copy is durable, so the offset may pass it. It
// returns false if ctx ended or src stopped first.
func (c *Consumer) recordDeadLettered(ctx context.Context, rec *kgo.Record, entry dedup.Entry, src Source) bool {
	failed := 0
	for n := 1; ; n++ {
		_, err := c.inbox.Claim(ctx, c.cfg.Pool, entry)
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return false
		}
		args := []any{"topic", rec.Topic, "partition", rec.Partition, "offset", rec.Offset,
			"message_id", entry.MessageID, "err", err}
		if databaseFailed(err) || isContention(err) {
			src.DatabaseDown(databaseFailed(err))
			c.outage.Warn(ctx, "oncely dead-letter inbox row failed on the database; retrying", args...)
		} else {
			src.DatabaseDown(false)
			failed++
			if failed >= deadLetterRowAttempts {
				c.cfg.Logger.Error("oncely dead-lettered record left without its inbox row; a redelivery of its id runs again",
					append(args, "attempts", failed)...)
				break
			}
			msg := "oncely dead-letter inbox row failed; retrying"
			if entry.Redrive {
				entry.Redrive = false
				msg = "oncely dead-letter inbox row with a redrive grant failed; retrying without the grant"
			}
			c.outage.Log(ctx, slog.LevelError, "oncely dead-letter inbox row failed", msg, args...)
		}
		if !src.Pause(c.backoff.Delay(n)) {
			return false
		}
	}
	src.DatabaseDown(false)
	return true
}

// hook runs a test hook; a simulated crash stops the run and reports false.
func (w *worker) hook(h func(*kgo.Record) error, rec *kgo.Record) bool {
	if h == nil {
		return true
	}
	if err := h(rec); errors.Is(err, testhook.ErrCrash) {
		w.r.crashed.Store(true)
		w.r.fail(fmt.Errorf("consumer: %w", err))
		return false
	}
	return true
}

// sleep waits d, or less if the worker is stopped or abandoned (false).
func (w *worker) sleep(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-w.stop:
		return false
	case <-w.ctx.Done():
		return false
	}
}

// maxTooLargeRetries bounds how often a dead-letter copy that fits its
// topic is produced again after its batch was refused as too large.
const maxTooLargeRetries = 3

// fitsTopic reports whether rec, alone in a record batch, is within its
// topic's max.message.bytes (asked of the brokers) and cl's batch limit;
// false when the brokers do not tell.
func fitsTopic(ctx context.Context, cl *kgo.Client, topic string, rec *kgo.Record, timeout time.Duration) bool {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	configs, err := kadm.NewClient(cl).DescribeTopicConfigs(ctx, topic)
	if err != nil {
		return false
	}
	rc, err := configs.On(topic, nil)
	if err != nil || rc.Err != nil {
		return false
	}
	limit := 0
	for _, cfg := range rc.Configs {
		if cfg.Key == "max.message.bytes" {
			limit, _ = strconv.Atoi(cfg.MaybeValue())
		}
	}
	if fn, ok := cl.OptValue(kgo.ProducerBatchMaxBytesFn).(func(string) int32); ok && fn != nil {
		limit = min(limit, int(fn(topic)))
	}
	// The 61-byte batch header, and generous varint framing for the
	// record and each header.
	return 61+64+10*len(rec.Headers)+recordSize(rec) <= limit
}

// oversized reports whether rec exceeds MaxRecordBytes: it is dead-lettered
// without running (class oversized).
func (c *Consumer) oversized(rec *kgo.Record) bool {
	return c.cfg.MaxRecordBytes > 0 && recordSize(rec) > c.cfg.MaxRecordBytes
}

func recordSize(rec *kgo.Record) int {
	n := len(rec.Key) + len(rec.Value)
	for _, h := range rec.Headers {
		n += len(h.Key) + len(h.Value)
	}
	return n
}

func isRedrive(rec *kgo.Record) bool {
	_, ok := redriveRef(rec)
	return ok
}

// redriveRef returns the value of rec's dlq.HeaderRedrive header: the
// dead-letter record it says it was redriven from.
func redriveRef(rec *kgo.Record) (string, bool) {
	for _, h := range rec.Headers {
		if h.Key == dlq.HeaderRedrive {
			return string(h.Value), true
		}
	}
	return "", false
}

type result struct {
	id        string
	duplicate bool
	deferred  bool // batch mode: not run, an earlier record with its key failed
	err       error
	infra     bool // the database, not the handler, failed
	// contention: the transaction lost to another (deadlock, serialization
	// failure, lock timeout); retried without spending an attempt.
	contention bool
	// stopped: ctx ended, or the worker stopped, before the attempt's
	// transaction had its turn and a slot; nothing ran.
	stopped bool

	spanContext trace.SpanContext // the attempt's span
}

// attempt is the record path: one transaction whose first statement claims
// the message id; the handler runs only for a new claim; then commit. The
// transaction first waits for its turn and a slot (enterTx).
func (c *Consumer) attempt(ctx context.Context, rec *kgo.Record, attempt int, src Source) (res result) {
	id, idErr := c.messageID(rec)
	if idErr != nil {
		id = c.fallbackID(rec)
	}
	var msg *Message
	var locks []int64
	var keysErr error
	if idErr == nil {
		msg = newMessage(rec, id, attempt)
		locks, keysErr = c.conflictKeys(nil, msg)
	}
	// The record's turn among the member's transactions that share its
	// keys, then a transaction slot, for a record that gets as far as a
	// transaction.
	var ids []int64
	if idErr == nil && keysErr == nil {
		ids = c.locking(locks)
		leave, ok := c.enterTx(ctx, ids, rec, src)
		if !ok {
			res.stopped = true
			return res
		}
		defer leave()
	}
	start := time.Now()
	ctx, span := c.startProcessSpan(ctx, rec, id, attempt)
	defer func() { c.endProcessSpan(ctx, span, rec, start, res) }()
	res.spanContext = span.SpanContext()
	if idErr != nil {
		res.id, res.err = id, dlq.Undecodable(idErr)
		return res
	}
	res.id = id
	msg.ctx = ctx
	if keysErr != nil {
		res.err = keysErr
		return res
	}
	// BEGIN, the claim and the conflict locks travel in one round trip.
	ref, redrive := redriveRef(rec)
	ctx, woke := c.wakes(ctx)
	tx, claimed, err := c.inbox.BeginClaim(ctx, c.cfg.Pool, dedup.Entry{
		Group: c.cfg.Group, MessageID: id, Topic: rec.Topic, Partition: rec.Partition, Offset: rec.Offset,
		Redrive: redrive, RedriveRef: ref,
	}, conflictLocks(ids)...)
	if err != nil {
		res.err, res.contention, res.infra = err, isContention(err), databaseFailed(err)
		return res
	}
	committing := false
	defer func() {
		if !committing {
			rollback(ctx, tx)
		}
	}()
	if !claimed {
		res.duplicate = true
		return res
	}
	if err := callHandler(ctx, c.handler, tx, msg); err != nil {
		res.err, res.infra, res.contention = err, handlerDatabaseFailed(ctx, err, tx), isContention(err)
		return res
	}
	committing = true // a failed Commit ends the transaction too
	if err := tx.Commit(ctx); err != nil {
		res.err, res.infra, res.contention = fmt.Errorf("consumer: commit: %w", err), databaseFailed(err), isContention(err)
		return res
	}
	woke()
	return res
}

// startProcessSpan starts the attempt's "process <topic>" CONSUMER span. It
// is linked to the message's creation context (the producer's span, carried
// in the record's traceparent header) and, unless UntrustedProducers, is
// parented to it too.
func (c *Consumer) startProcessSpan(ctx context.Context, rec *kgo.Record, id string, attempt int) (context.Context, trace.Span) {
	// The topic's attributes, which samplers may look at, are given at the
	// start; the record's own are set only on a span that records, so that
	// an unsampled or untraced record costs no attribute building.
	opts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer), c.spanStartAttrs(rec.Topic)}
	if creation := telemetry.Extract(rec.Headers); creation.IsValid() {
		opts = append(opts, trace.WithLinks(trace.Link{SpanContext: creation}))
		if c.cfg.UntrustedProducers {
			opts = append(opts, trace.WithNewRoot())
		} else {
			ctx = trace.ContextWithRemoteSpanContext(ctx, creation)
		}
	}
	ctx, span := c.tracer.Start(ctx, "process "+rec.Topic, opts...)
	if span.IsRecording() {
		span.SetAttributes(
			telemetry.MessagingMessageID.String(id),
			telemetry.Attempt.Int(attempt),
		)
		if kv, ok := ctx.Value(spanAttrsKey{}).([]attribute.KeyValue); ok { // a broker's own
			span.SetAttributes(kv...)
		}
		if c.cfg.system == "" { // a Kafka record's own
			span.SetAttributes(
				telemetry.MessagingPartition.String(strconv.FormatInt(int64(rec.Partition), 10)),
				telemetry.MessagingKafkaOffset.Int64(rec.Offset),
			)
		}
		if c.cfg.RecordKeyAttribute && rec.Key != nil {
			span.SetAttributes(telemetry.MessagingKafkaKey.String(string(rec.Key)))
		}
	}
	return ctx, span
}

// spanStartAttrs returns the start attributes of a topic's process spans,
// built once per topic.
func (c *Consumer) spanStartAttrs(topic string) trace.SpanStartEventOption {
	if o, ok := c.spanAttrs.Load(topic); ok {
		return o.(trace.SpanStartEventOption)
	}
	o, _ := c.spanAttrs.LoadOrStore(topic, trace.WithAttributes(
		c.system,
		telemetry.MessagingDestination.String(topic),
		telemetry.MessagingOperationType.String("process"),
		telemetry.MessagingOperationName.String("process"),
		telemetry.MessagingConsumerGroup.String(c.cfg.Group),
	))
	return o.(trace.SpanStartEventOption)
}

func (c *Consumer) endProcessSpan(ctx context.Context, span trace.Span, rec *kgo.Record, start time.Time, res result) {
	outcome := "new"
	switch {
	case res.duplicate:
		outcome = "duplicate"
	case isRedrive(rec):
		outcome = "redrive"
	}
	key := attrKey{topic: rec.Topic, process: true}
	if res.err != nil {
		kind := "handler"
		switch {
		case res.infra:
			kind = "database"
		case res.contention:
			kind = "contention"
		case errors.As(res.err, new(*PanicError)):
			kind = "panic"
		default:
			if class, ok := dlq.PermanentClass(res.err); ok {
				kind = string(class)
			}
		}
		telemetry.Fail(span, res.err, kind)
		key.errorType = kind
	} else {
		span.SetAttributes(telemetry.DedupOutcome.String(outcome))
	}
	span.End()
	c.metrics.processDuration.Record(ctx, time.Since(start).Seconds(), c.metricAttrs(key))
}

// rollback ends a transaction that was not committed. It has a bound of its
// own, as ctx may be what ended the attempt.
func rollback(ctx context.Context, tx pgx.Tx) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_ = tx.Rollback(rctx)
}

func callHandler(ctx context.Context, h Handler, tx pgx.Tx, msg *Message) (err error) {
	defer recoverPanic(&err)
	return h(ctx, tx, msg)
}

func callBatchHandler(ctx context.Context, h BatchHandler, tx pgx.Tx, msgs []*Message) (err error) {
	defer recoverPanic(&err)
	return h(ctx, tx, msgs)
}

func recoverPanic(err *error) {
	if v := recover(); v != nil {
		*err = &PanicError{Value: v, Stack: debug.Stack()}
	}
}

// messageID returns the dedup id of rec: KeyFunc, else the message-id
// header, else topic/partition/offset.
func (c *Consumer) messageID(rec *kgo.Record) (string, error) {
	var id string
	if c.cfg.KeyFunc != nil {
		var err error
		if id, err = callKeyFunc(c.cfg.KeyFunc, rec); err != nil {
			return "", fmt.Errorf("consumer: key func: %w", err)
		}
		if id == "" {
			return "", errors.New("consumer: key func returned an empty id")
		}
	} else if id = c.headerID(rec); id == "" {
		id = c.fallbackID(rec)
	}
	if len(id) > MaxMessageIDLen {
		return "", fmt.Errorf("consumer: message id of %d bytes exceeds %d", len(id), MaxMessageIDLen)
	}
	// Postgres text holds neither: the claim would fail on every attempt.
	// A Java producer putting a raw 16-byte UUID in the header does this.
	if !utf8.ValidString(id) || strings.IndexByte(id, 0) >= 0 {
		return "", fmt.Errorf("consumer: message id %s is not valid UTF-8 text without NUL bytes", strconv.QuoteToASCII(id))
	}
	return id, nil
}

// headerID returns the first non-empty message id header of rec, in any
// casing: producers write Message-ID as often as message-id, and a missed
// header would dedup by offset, not by message.
func (c *Consumer) headerID(rec *kgo.Record) string {
	for _, h := range rec.Headers {
		if len(h.Value) > 0 && strings.EqualFold(h.Key, c.cfg.MessageIDHeader) {
			return string(h.Value)
		}
	}
	return ""
}

// callKeyFunc runs f, turning a panic into an error: the record is
// undecodable, and the process lives on.
func callKeyFunc(f KeyFunc, rec *kgo.Record) (id string, err error) {
	defer recoverPanic(&err)
	return f(rec)
}

// fallbackID is the dedup id of a record without a message id.
func (c *Consumer) fallbackID(rec *kgo.Record) string {
	return fmt.Sprintf("%s/%d/%d", rec.Topic, rec.Partition, rec.Offset)
}

// startOffset is where a partition without a committed offset starts.
func startOffset(s StartOffset) kgo.Offset {
	if s == StartLatest {
		return kgo.NewOffset().AtEnd()
	}
	return kgo.NewOffset().AtStart()
}
