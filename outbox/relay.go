package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/oncely/oncely/internal/backoff"
	"github.com/oncely/oncely/internal/brokercheck"
	"github.com/oncely/oncely/internal/ratelog"
	"github.com/oncely/oncely/internal/telemetry"
	"github.com/oncely/oncely/internal/testhook"
)

// RelayConfig configures a Relay. Zero values take the documented defaults.
type RelayConfig struct {
	// Outbox is the schema and shard layout. Required fields: none;
	// defaults as in Config.
	Outbox Config
	// Pool runs the relay's transactions. Required.
	Pool *pgxpool.Pool
	// Brokers are the seed brokers. Required, unless Publisher is set.
	Brokers []string
	// Publisher, when set, publishes the rows instead of a Kafka producer:
	// to another broker (package natsconsumer's JetStreamPublisher,
	// package rabbitconsumer's Publisher). The
	// Kafka fields (Brokers, ClientOpts, ClientID) are then unused.
	Publisher Publisher
	// ClientOpts are extra franz-go options (TLS, SASL...), applied after
	// the relay's own (a kgo.ClientID here wins over ClientID).
	ClientOpts []kgo.Opt
	// ClientID is the Kafka client id of the relay's producer: brokers log
	// it and apply quotas to it. Default "oncely-<hostname>-<pid>".
	ClientID string

	// BatchSize bounds the rows published per shard transaction. Default 500.
	BatchSize int
	// PollInterval is the fallback wake-up when no notification arrives.
	// Default 1s.
	PollInterval time.Duration
	// NotifyDebounce gathers notifications arriving close together into
	// one wake-up. Default 5ms.
	NotifyDebounce time.Duration
	// ProduceTimeout bounds one batch's produce (at least 1s), but for a
	// produce request whose answer was lost (see Run). Default 10s.
	ProduceTimeout time.Duration
	// RetryBaseDelay and RetryMaxDelay shape the per-shard backoff after a
	// failed publish. Defaults 100ms and 10s.
	RetryBaseDelay, RetryMaxDelay time.Duration

	// Retention is how long sent rows are kept; then they are deleted in
	// batches of CleanupBatch every CleanupInterval. Default 24h.
	Retention       time.Duration
	CleanupInterval time.Duration // default 1m
	CleanupBatch    int           // default 1000

	// TracerProvider and MeterProvider instrument the relay: a "send
	// <topic>" PRODUCER span per record, continuing the enqueuer's trace,
	// and messaging metrics. Default: the global providers.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider

	// Logger receives the relay's logs. Default: discard.
	Logger *slog.Logger
	// LogInterval rate-limits the warnings that repeat while the database
	// or the brokers are unreachable (reading or publishing a shard, the
	// notification listener, retention): each kind is logged at most once
	// per LogInterval, and the line that goes out counts those held back
	// (attribute "suppressed"). Default 10s.
	LogInterval time.Duration
}

// Relay publishes committed outbox rows to Kafka.
type Relay struct {
	cfg     RelayConfig
	outbox  *Outbox
	backoff backoff.Policy
	started atomic.Bool
	q       relayQueries
	tracer  trace.Tracer
	meter   metric.Meter
	sent    metric.Int64Counter
	sendDur metric.Float64Histogram
	outage  *ratelog.Limiter
	pending metric.Int64ObservableGauge
	oldest  metric.Float64ObservableGauge
	parkedG metric.Int64ObservableGauge

	published, batches, produceErrs, deleted, parked atomic.Int64
	running, dbDown                                  atomic.Bool
	// brokers says whether a broker answered the last check; not until
	// the first check answers.
	brokers brokercheck.State
}

type relayQueries struct {
	shards, lock, selectBatch, markSent, park, backlog string
}

// RelayStats are a relay's counters.
type RelayStats struct {
	Published     int64 // rows published and marked sent
	Batches       int64 // shard transactions that published rows
	ProduceErrors int64 // failed batch produces (rows stayed pending)
	Deleted       int64 // sent rows removed by retention
	Parked        int64 // rows this relay parked (refused for good); a row parked again after a retry counts again
}

// NewRelay validates cfg and returns a Relay.
func NewRelay(cfg RelayConfig) (*Relay, error) {
	o, err := New(cfg.Outbox)
	if err != nil {
		return nil, err
	}
	switch {
	case cfg.Pool == nil:
		return nil, errors.New("outbox: RelayConfig.Pool: a *pgxpool.Pool is required")
	case len(cfg.Brokers) == 0 && cfg.Publisher == nil:
		return nil, errors.New("outbox: RelayConfig.Brokers: at least one seed broker is required")
	case cfg.ProduceTimeout != 0 && cfg.ProduceTimeout < time.Second:
		return nil, fmt.Errorf("outbox: RelayConfig.ProduceTimeout: must be at least 1s, got %s", cfg.ProduceTimeout)
	}
	for i, b := range cfg.Brokers {
		if b == "" {
			return nil, fmt.Errorf("outbox: RelayConfig.Brokers: broker %d is empty", i)
		}
	}
	for _, f := range []struct {
		name     string
		negative bool
		v        any
	}{
		{"BatchSize", cfg.BatchSize < 0, cfg.BatchSize}, {"PollInterval", cfg.PollInterval < 0, cfg.PollInterval},
		{"NotifyDebounce", cfg.NotifyDebounce < 0, cfg.NotifyDebounce}, {"Retention", cfg.Retention < 0, cfg.Retention},
		{"CleanupInterval", cfg.CleanupInterval < 0, cfg.CleanupInterval}, {"CleanupBatch", cfg.CleanupBatch < 0, cfg.CleanupBatch},
		{"RetryBaseDelay", cfg.RetryBaseDelay < 0, cfg.RetryBaseDelay}, {"RetryMaxDelay", cfg.RetryMaxDelay < 0, cfg.RetryMaxDelay},
		{"LogInterval", cfg.LogInterval < 0, cfg.LogInterval},
	} {
		if f.negative {
			return nil, fmt.Errorf("outbox: RelayConfig.%s: must not be negative, got %v", f.name, f.v)
		}
	}
	cfg.BatchSize = cmp.Or(cfg.BatchSize, 500)
	cfg.PollInterval = cmp.Or(cfg.PollInterval, time.Second)
	cfg.NotifyDebounce = cmp.Or(cfg.NotifyDebounce, 5*time.Millisecond)
	cfg.ProduceTimeout = cmp.Or(cfg.ProduceTimeout, 10*time.Second)
	cfg.RetryBaseDelay = cmp.Or(cfg.RetryBaseDelay, 100*time.Millisecond)
	cfg.RetryMaxDelay = cmp.Or(cfg.RetryMaxDelay, 10*time.Second)
	cfg.Retention = cmp.Or(cfg.Retention, 24*time.Hour)
	cfg.CleanupInterval = cmp.Or(cfg.CleanupInterval, time.Minute)
	cfg.CleanupBatch = cmp.Or(cfg.CleanupBatch, 1000)
	cfg.Logger = cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	cfg.LogInterval = cmp.Or(cfg.LogInterval, ratelog.DefaultInterval)
	cfg.ClientID = telemetry.ClientID(cfg.ClientID)
	if cfg.RetryMaxDelay < cfg.RetryBaseDelay {
		return nil, fmt.Errorf("outbox: RelayConfig.RetryMaxDelay: %s is below RetryBaseDelay %s", cfg.RetryMaxDelay, cfg.RetryBaseDelay)
	}
	t := o.table
	meter := telemetry.Meter(cfg.MeterProvider)
	sent, err1 := meter.Int64Counter("messaging.client.sent.messages", metric.WithUnit("{message}"),
		metric.WithDescription("Records oncely produced (outbox relay, dead-letter writes); error.type is set when the produce failed."))
	pending, err2 := meter.Int64ObservableGauge("oncely.outbox.pending", metric.WithUnit("{message}"),
		metric.WithDescription("Outbox rows not yet published."))
	oldest, err3 := meter.Float64ObservableGauge("oncely.outbox.oldest_pending_age", metric.WithUnit("s"),
		metric.WithDescription("Age of the oldest unpublished outbox row: the relay's lag."))
	parked, err4 := meter.Int64ObservableGauge("oncely.outbox.parked", metric.WithUnit("{message}"),
		metric.WithDescription("Outbox rows the broker refused for good, waiting for `oncely outbox retry` or `discard`; later rows of their keys wait behind them."))
	sendDur, err5 := telemetry.DurationHistogram(meter, "messaging.client.operation.duration",
		"Duration of the relay's produce calls, from the first record sent to the last acknowledgement.")
	if err := errors.Join(err1, err2, err3, err4, err5); err != nil {
		return nil, fmt.Errorf("outbox: metrics: %w", err)
	}
	return &Relay{
		cfg: cfg, outbox: o,
		tracer: telemetry.Tracer(cfg.TracerProvider), meter: meter, sent: sent, sendDur: sendDur, pending: pending, oldest: oldest, parkedG: parked,
		backoff: backoff.Policy{Base: cfg.RetryBaseDelay, Max: cfg.RetryMaxDelay},
		outage:  ratelog.New(cfg.Logger, cfg.LogInterval),
		q: relayQueries{
			shards: `SELECT shard FROM ` + t + ` WHERE sent_at IS NULL AND parked_at IS NULL GROUP BY shard`,
			lock:   `SELECT pg_try_advisory_xact_lock(hashtext($1), $2)`,
			// Rows behind a parked row of their (topic, key) are held back:
			// publishing them would put them before it.
			selectBatch: `SELECT id, message_id, topic, key, value, header_keys, header_values FROM ` + t + ` o
				WHERE shard = $1 AND sent_at IS NULL AND parked_at IS NULL AND NOT EXISTS (
					SELECT 1 FROM ` + t + ` p WHERE p.shard = $1 AND p.parked_at IS NOT NULL AND p.sent_at IS NULL
					AND p.id < o.id AND p.topic = o.topic AND p.key = o.key)
				ORDER BY id LIMIT $2`,
			markSent: `UPDATE ` + t + ` SET sent_at = now() WHERE id = ANY($1)`,
			// The gauges' exact counts read the unsent rows only, through
			// the partial indexes: the cost follows the backlog, not the
			// sent rows kept for the retention (Status counts those too).
			backlog: `SELECT
				(SELECT count(*) FROM ` + t + ` WHERE sent_at IS NULL AND parked_at IS NULL),
				(SELECT coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 FROM ` + t + ` WHERE sent_at IS NULL AND parked_at IS NULL),
				(SELECT count(*) FROM ` + t + ` WHERE parked_at IS NOT NULL AND sent_at IS NULL)`,
			park: `UPDATE ` + t + ` o SET parked_at = now(), error = e.error
				FROM unnest($1::bigint[], $2::text[]) AS e(id, error) WHERE o.id = e.id`,
		},
	}, nil
}

// Stats returns the relay's counters.
func (r *Relay) Stats() RelayStats {
	return RelayStats{Published: r.published.Load(), Batches: r.batches.Load(),
		ProduceErrors: r.produceErrs.Load(), Deleted: r.deleted.Load(), Parked: r.parked.Load()}
}

// Ready reports whether Run is publishing, the database answered the
// relay's most recent query (it asks at least every PollInterval), and a
// Kafka broker answered its most recent check (made every PollInterval, or
// every 2s when PollInterval is longer). Use it for readiness probes: while
// either is unreachable the relay publishes nothing, and its rows wait in
// the outbox. NotReady says why it is false.
func (r *Relay) Ready() bool { return r.NotReady() == "" }

// brokerCheckInterval bounds how often the relay checks that a broker
// answers.
const brokerCheckInterval = 2 * time.Second

// NotReady says why Ready is false, for a readiness probe's answer; "" when
// it is true.
func (r *Relay) NotReady() string {
	why, down := r.brokers.Down()
	switch {
	case !r.running.Load():
		return "not publishing (starting, stopped or failed)"
	case r.dbDown.Load():
		return "the database did not answer its last query"
	case down:
		return why
	}
	return ""
}

// Run publishes until ctx is done, then returns nil after the batch in
// flight: within ProduceTimeout, unless a produce request was written and
// its answer lost (the connection dropped, or the broker stopped
// answering). The idempotent Kafka producer cannot tell whether such a
// batch was written, so it retries it until a broker answers rather than
// fail its records. It may be called once.
func (r *Relay) Run(ctx context.Context) error {
	if !r.started.CompareAndSwap(false, true) {
		return errors.New("outbox: Relay.Run called more than once")
	}
	pub := r.cfg.Publisher
	var cl *kgo.Client
	if pub == nil {
		var err error
		queued := &queuedHook{}
		cl, err = kgo.NewClient(append([]kgo.Opt{
			kgo.SeedBrokers(r.cfg.Brokers...),
			kgo.RequiredAcks(kgo.AllISRAcks()), // idempotent by default
			kgo.RecordDeliveryTimeout(r.cfg.ProduceTimeout),
			// Publish buffers a whole batch before it sends any (see there).
			kgo.ManualFlushing(),
			kgo.MaxBufferedRecords(max(r.cfg.BatchSize, 10_000)),
			kgo.WithHooks(queued),
			kgo.ClientID(r.cfg.ClientID),
		}, r.cfg.ClientOpts...)...)
		if err != nil {
			return fmt.Errorf("outbox: kafka client: %w", err)
		}
		defer cl.Close()
		pub = kafkaPublisher{cl, queued}
		// Not ready until a broker answered: set before running, so that
		// no moment of running shows the state of no check at all as
		// ready.
		r.brokers.Unchecked()
	}
	r.running.Store(true)
	defer r.running.Store(false)
	hooks := testhook.RelayFrom(ctx)
	if reg, err := r.meter.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		var pending, parked int64
		var oldest float64
		if err := r.cfg.Pool.QueryRow(ctx, r.q.backlog).Scan(&pending, &oldest, &parked); err != nil {
			return fmt.Errorf("outbox: gauges: %w", err)
		}
		attrs := metric.WithAttributes(attribute.String("db.namespace", r.outbox.schema))
		o.ObserveInt64(r.pending, pending, attrs)
		o.ObserveFloat64(r.oldest, oldest, attrs)
		o.ObserveInt64(r.parkedG, parked, attrs)
		return nil
	}, r.pending, r.oldest, r.parkedG); err == nil {
		defer func() { _ = reg.Unregister() }()
	}

	wake := make(chan struct{}, 1)
	var wg sync.WaitGroup
	defer wg.Wait()
	bg, stopBG := context.WithCancel(ctx) // the helpers stop however Run returns
	defer stopBG()
	wg.Add(2)
	go func() { defer wg.Done(); r.listen(bg, wake) }()
	go func() { defer wg.Done(); r.cleanup(bg) }()
	if cl != nil {
		// Checked every PollInterval, or every brokerCheckInterval when
		// that is shorter.
		wg.Add(1)
		go func() {
			defer wg.Done()
			brokercheck.Watch(bg, cl, r.cfg.Brokers, max(min(r.cfg.PollInterval, brokerCheckInterval), 100*time.Millisecond),
				&r.brokers, r.cfg.Logger, "oncely outbox relay")
		}()
	}

	r.cfg.Logger.Info("oncely outbox relay started", "schema", r.outbox.schema, "shards", r.outbox.shards, "client_id", r.cfg.ClientID)
	retryAt := map[int]time.Time{}
	failures := map[int]int{}
	poll := time.NewTimer(0)
	defer poll.Stop()
	for {
		busy, next, crash := r.cycle(ctx, pub, hooks, retryAt, failures)
		if crash != nil {
			return fmt.Errorf("outbox: relay: %w", crash)
		}
		if ctx.Err() != nil {
			r.cfg.Logger.Info("oncely outbox relay stopped")
			return nil
		}
		if busy {
			continue
		}
		d := r.cfg.PollInterval
		if !next.IsZero() {
			d = min(d, max(time.Until(next), time.Millisecond))
		}
		poll.Reset(d)
		select {
		case <-ctx.Done():
			r.cfg.Logger.Info("oncely outbox relay stopped")
			return nil
		case <-poll.C:
		case <-wake:
			if !poll.Stop() {
				<-poll.C
			}
			debounce(ctx, r.cfg.NotifyDebounce)
		}
	}
}

func debounce(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// cycle publishes one batch of every shard with pending rows that is not
// backing off. busy reports a full batch (more is likely waiting); next is
// the earliest retry time of a backing-off shard.
func (r *Relay) cycle(ctx context.Context, pub Publisher, hooks *testhook.Relay, retryAt map[int]time.Time, failures map[int]int) (busy bool, next time.Time, crash error) {
	rows, err := r.cfg.Pool.Query(ctx, r.q.shards)
	var shards []int
	if err == nil {
		shards, err = pgx.CollectRows(rows, pgx.RowTo[int])
	}
	if err != nil {
		if ctx.Err() == nil {
			r.dbDown.Store(true)
			r.outage.Warn(ctx, "oncely outbox: reading pending shards failed", "err", err)
		}
		return false, time.Now().Add(r.backoff.Delay(1)), nil
	}
	r.dbDown.Store(false)
	rand.Shuffle(len(shards), func(i, j int) { shards[i], shards[j] = shards[j], shards[i] })
	now := time.Now()
	for _, shard := range shards {
		if at, ok := retryAt[shard]; ok && now.Before(at) {
			if next.IsZero() || at.Before(next) {
				next = at
			}
			continue
		}
		more, err := r.publishShard(ctx, pub, hooks, shard)
		if ctx.Err() != nil {
			return false, next, nil
		}
		if errors.Is(err, testhook.ErrCrash) {
			return false, next, err // a simulated crash: stop with the transaction rolled back
		}
		if err != nil {
			failures[shard]++
			at := time.Now().Add(r.backoff.Delay(failures[shard]))
			retryAt[shard] = at
			if next.IsZero() || at.Before(next) {
				next = at
			}
			r.outage.Warn(ctx, "oncely outbox: publishing shard failed; rows stay pending", "shard", shard,
				"attempt", failures[shard], "retry_at", at, "err", err)
			continue
		}
		delete(retryAt, shard)
		delete(failures, shard)
		busy = busy || more
	}
	return busy, next, nil
}

// publishShard publishes up to BatchSize pending rows of shard in id order,
// holding the shard's advisory lock, and marks them sent in the same
// transaction after the broker acknowledged them. Rows the broker refused
// for good are parked in the same transaction (see produce). more reports
// that rows are likely waiting; it is false when another relay holds the
// shard.
func (r *Relay) publishShard(ctx context.Context, pub Publisher, hooks *testhook.Relay, shard int) (more bool, err error) {
	tx, err := r.cfg.Pool.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = tx.Rollback(rctx)
	}()
	// A relay cut off from Postgres must not hold the shard forever.
	idle := strconv.FormatInt((2 * r.cfg.ProduceTimeout).Milliseconds(), 10)
	if _, err := tx.Exec(ctx, `SELECT set_config('idle_in_transaction_session_timeout', $1, true)`, idle); err != nil {
		return false, err
	}
	var locked bool
	if err := tx.QueryRow(ctx, r.q.lock, "oncely.outbox."+r.outbox.schema, shard).Scan(&locked); err != nil {
		return false, err
	}
	if !locked {
		return false, nil
	}
	rows, err := tx.Query(ctx, r.q.selectBatch, shard, r.cfg.BatchSize)
	if err != nil {
		return false, err
	}
	var (
		ids  []int64
		recs []*kgo.Record
	)
	var (
		id       int64
		msgID    string
		topic    string
		key, val []byte
		hks      []string
		hvs      [][]byte
	)
	_, err = pgx.ForEachRow(rows, []any{&id, &msgID, &topic, &key, &val, &hks, &hvs}, func() error {
		rec := &kgo.Record{Topic: topic, Key: key, Value: val, Headers: make([]kgo.RecordHeader, len(hks))}
		for i := range hks {
			rec.Headers[i] = kgo.RecordHeader{Key: hks[i], Value: hvs[i]}
		}
		ids, recs = append(ids, id), append(recs, rec)
		return nil
	})
	if err != nil || len(recs) == 0 {
		return false, err
	}
	ok, park, err := r.produce(ctx, pub, ids, recs)
	if len(ok) == 0 && len(park) == 0 {
		return false, err
	}
	if err != nil {
		// Transient: the rows left stay pending; keep what was settled.
		r.outage.Warn(ctx, "oncely outbox: produce failed part-way; the rest of the batch stays pending",
			"shard", shard, "settled", len(ok)+len(park), "err", err)
	}
	if h := hooks.AfterProduce; h != nil {
		if err := h(len(ok)); err != nil {
			return false, err
		}
	}
	if _, err := tx.Exec(ctx, r.q.markSent, ok); err != nil {
		return false, fmt.Errorf("mark sent: %w", err)
	}
	if len(park) > 0 {
		pids, perrs := make([]int64, 0, len(park)), make([]string, 0, len(park))
		for i, e := range park {
			pids, perrs = append(pids, ids[i]), append(perrs, e.Error())
		}
		if _, err := tx.Exec(ctx, r.q.park, pids, perrs); err != nil {
			return false, fmt.Errorf("park: %w", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return false, fmt.Errorf("commit: %w", err)
	}
	for i, e := range park {
		rec := recs[i]
		r.cfg.Logger.Error("oncely outbox: row parked: the broker will not accept it; later rows of its key wait behind it "+
			"(oncely outbox parked|retry|discard)", "id", ids[i], "message_id", (telemetry.Carrier{Headers: &rec.Headers}).Get(MessageIDHeader),
			"topic", rec.Topic, "shard", shard, "bytes", recordBytes(rec), "err", e)
	}
	r.published.Add(int64(len(ok)))
	r.parked.Add(int64(len(park)))
	r.batches.Add(1)
	// A full batch, or rows of this one held behind a row that failed:
	// another round at once.
	return err == nil && (len(recs) == r.cfg.BatchSize || len(ok)+len(park) < len(recs)), err
}

// produce publishes recs (rows ids, in id order) and returns the ids the
// broker acknowledged and, by index, the rows to park with their reason.
// Rows after a parked or transiently failed row of their (topic, key) are in
// neither: they stay pending, held back (order is kept). err is the first
// transient failure: the rows it touched stay pending, and the shard backs
// off once what was settled is committed.
//
// A row is parked when Kafka refuses it for a reason retrying cannot change
// (see permanent): the client's own size limit and an invalid topic name are
// checked before producing; a row that failed permanently in the batch is
// produced again on its own before it is parked, so that only the culprit
// is parked and rows that merely shared its Kafka batch go through.
func (r *Relay) produce(ctx context.Context, pub Publisher, ids []int64, recs []*kgo.Record) (ok []int64, park map[int]error, err error) {
	park = map[int]error{}
	blocked := map[string]bool{} // (topic, key) of rows parked or failed in this batch
	held := func(i int) bool { return recs[i].Key != nil && blocked[keyOf(recs[i])] }
	block := func(i int) {
		if recs[i].Key != nil {
			blocked[keyOf(recs[i])] = true
		}
	}
	var send []int
	for i, rec := range recs {
		if held(i) {
			continue
		}
		if err := pub.Refuse(rec); err != nil {
			park[i] = err
			block(i)
			continue
		}
		send = append(send, i)
	}
	results := r.send(ctx, pub, recs, send)
	var suspects []int
	for j, res := range results { // in id order
		i := send[j]
		switch {
		case held(i):
			// An earlier row of its key failed: it stays pending and goes
			// again after that one. (A Publisher keeps it off the broker
			// meanwhile; see Publisher.Publish. Should one fail to, say so:
			// consumers read it before that row, and again after it.)
			if res == nil {
				r.cfg.Logger.Error("oncely outbox: a row reached the broker ahead of an earlier row of its key that failed; "+
					"it is published again after that row", "id", ids[i],
					"message_id", (telemetry.Carrier{Headers: &recs[i].Headers}).Get(MessageIDHeader), "topic", recs[i].Topic)
			}
		case res == nil:
			ok = append(ok, ids[i])
		case pub.Permanent(res):
			suspects = append(suspects, i)
			block(i)
		default:
			err = cmp.Or(err, res)
			block(i)
		}
	}
	clear(blocked) // the suspects go alone, each first of its key in this batch
	for i := range park {
		block(i)
	}
	if len(suspects) > 0 || err != nil {
		r.produceErrs.Add(1)
	}
	for _, i := range suspects { // in id order
		switch res := r.send(ctx, pub, recs, []int{i})[0]; {
		case res == nil:
			ok = append(ok, ids[i])
		case pub.Permanent(res):
			park[i] = res
			block(i)
		default:
			r.produceErrs.Add(1)
			err = cmp.Or(err, res)
			block(i)
		}
	}
	if err != nil {
		err = fmt.Errorf("produce %d records: %w", len(send), err)
	}
	return ok, park, err
}

// send publishes recs[idx...] in one call, with a PRODUCER span each, and
// returns their errors in the order of idx.
func (r *Relay) send(ctx context.Context, pub Publisher, recs []*kgo.Record, idx []int) []error {
	if len(idx) == 0 {
		return nil
	}
	system := telemetry.MessagingSystem.String(pub.System())
	batch := make([]*kgo.Record, len(idx))
	spans := make([]trace.Span, len(idx))
	for j, i := range idx {
		recs[i].Context = nil // a record produced before keeps the ended context of that produce
		batch[j] = recs[i]
		spans[j] = r.startSend(ctx, system, recs[i])
	}
	pctx, cancel := context.WithTimeout(ctx, r.cfg.ProduceTimeout)
	start := time.Now()
	errs := pub.Publish(pctx, batch)
	took := time.Since(start)
	cancel()
	durAttrs := []attribute.KeyValue{system, telemetry.MessagingOperationName.String("send"),
		telemetry.MessagingOperationType.String("send")}
	if slices.ContainsFunc(errs, func(err error) bool { return err != nil }) {
		durAttrs = append(durAttrs, telemetry.ErrorType.String("produce"))
	}
	r.sendDur.Record(ctx, took.Seconds(), metric.WithAttributes(durAttrs...))
	for j, err := range errs {
		attrs := []attribute.KeyValue{system, telemetry.MessagingDestination.String(batch[j].Topic)}
		if err != nil {
			telemetry.Fail(spans[j], err, "produce")
			attrs = append(attrs, telemetry.ErrorType.String("produce"))
		} else if pub.System() == "kafka" {
			spans[j].SetAttributes(telemetry.MessagingPartition.String(strconv.FormatInt(int64(batch[j].Partition), 10)),
				telemetry.MessagingKafkaOffset.Int64(batch[j].Offset))
		}
		spans[j].End()
		r.sent.Add(ctx, 1, metric.WithAttributes(attrs...))
	}
	return errs
}

// A Publisher writes outbox rows to a broker (RelayConfig.Publisher). The
// relay keeps everything else: shards and their locks, per-key order,
// marking rows sent only after the broker confirmed them, parking what the
// broker refuses for good, spans and metrics.
type Publisher interface {
	// System is the broker's messaging.system ("kafka", "nats").
	System() string
	// Publish writes recs (Topic: the destination; Headers include
	// MessageIDHeader, the row's stable id) and returns an error per
	// record, in order: nil once the broker confirmed it durable. Once a
	// record fails, no later record of its (topic, key) in recs may reach
	// the broker: the relay publishes them again after it, and a copy
	// already there would be read first. Publishing in order and failing
	// the rest after the first error keeps that.
	Publish(ctx context.Context, recs []*kgo.Record) []error
	// Refuse returns why the broker would refuse rec for good, checked
	// before publishing; nil if it may go.
	Refuse(rec *kgo.Record) error
	// Permanent reports whether a publish error means that the broker
	// refuses the record for good: it is parked.
	Permanent(err error) bool
}

// kafkaPublisher produces to Kafka with all in-sync replicas' acks.
type kafkaPublisher struct {
	cl     *kgo.Client
	queued *queuedHook
}

func (kafkaPublisher) System() string { return "kafka" }

// Publish hands every record of recs to the client, waits until the client
// has queued each for its partition (or failed it), and then flushes them
// (the client flushes manually). So nothing goes out before the last record
// is queued, and when the broker refuses a batch, the client fails every
// later batch of that partition with it: a row of a key does not reach the
// topic after an earlier row of its key was refused. (Sending records as
// they are queued would let one queued after the refusal came back go out
// under a fresh producer epoch, ahead of the row it follows; the records
// of a topic the client has not loaded yet are queued only once its
// partitions are known, after Produce returned.) One narrow case remains:
// the client's sending loop for a broker can outlive a Flush when it was
// backing off after a retriable error while its records were settled
// otherwise (timed out, moved to another broker), and it then sends what
// the next call queues as it is queued.
//
// The records go in parts that fit the client's buffer (MaxBufferedRecords,
// MaxBufferedBytes, which ClientOpts may set), one part at a time; a record
// whose (topic, key) failed in an earlier part is not sent.
func (p kafkaPublisher) Publish(ctx context.Context, recs []*kgo.Record) []error {
	errs := make([]error, len(recs))
	maxRecs, _ := p.cl.OptValue(kgo.MaxBufferedRecords).(int64)
	maxBytes, _ := p.cl.OptValue(kgo.MaxBufferedBytes).(int64)
	failed := map[string]bool{}
	for start := 0; start < len(recs); {
		end, bytes := start, int64(0)
		for end < len(recs) && (maxRecs <= 0 || int64(end-start) < maxRecs) {
			n := recordBytes(recs[end])
			if maxBytes > 0 && end > start && bytes+n > maxBytes {
				break
			}
			bytes += n
			end++
		}
		part := make([]int, 0, end-start)
		for i := start; i < end; i++ {
			if recs[i].Key != nil && failed[keyOf(recs[i])] {
				errs[i] = errHeldBack
				continue
			}
			part = append(part, i)
		}
		p.produce(ctx, recs, part, errs)
		for _, i := range part {
			if errs[i] != nil && recs[i].Key != nil {
				failed[keyOf(recs[i])] = true
			}
		}
		start = end
	}
	return errs
}

// errHeldBack is the error of a record not sent because an earlier record
// of its (topic, key) failed in the same Publish.
var errHeldBack = errors.New("outbox: not sent: an earlier record of its key failed")

// produce publishes recs[idx...], setting their errors in errs: all queued,
// then flushed (see Publish).
func (p kafkaPublisher) produce(ctx context.Context, recs []*kgo.Record, idx []int, errs []error) {
	var queued, done sync.WaitGroup
	queued.Add(len(idx))
	done.Add(len(idx))
	for _, i := range idx {
		rec := recs[i]
		p.queued.expect(rec, queued.Done)
		p.cl.Produce(ctx, rec, func(_ *kgo.Record, err error) {
			errs[i] = err
			p.queued.settle(rec) // failed before it was queued
			done.Done()
		})
	}
	// Each record is queued or failed within its delivery timeout or its
	// context (ProduceTimeout), whether its topic is known or not.
	queued.Wait()
	// Flushing lasts until every record is settled: a manually flushed
	// client sends nothing, so fails nothing for its delivery timeout or
	// its context, once no flush is running.
	_ = p.cl.Flush(context.WithoutCancel(ctx))
	done.Wait()
}

// queuedHook calls the function expected for a record once the client has
// queued it for its partition (HookProduceRecordPartitioned), or, through
// settle, once it failed first.
type queuedHook struct{ m sync.Map } // *kgo.Record: func()

func (h *queuedHook) expect(rec *kgo.Record, fn func()) { h.m.Store(rec, fn) }

func (h *queuedHook) settle(rec *kgo.Record) {
	if fn, ok := h.m.LoadAndDelete(rec); ok {
		fn.(func())()
	}
}

// OnProduceRecordPartitioned is called with the partition's buffer locked:
// it only counts.
func (h *queuedHook) OnProduceRecordPartitioned(rec *kgo.Record, _ int32) { h.settle(rec) }

func (kafkaPublisher) Permanent(err error) bool { return permanent(err) }

// permanent reports whether Kafka refused a record for a reason that lies in
// the record or its topic and that retrying will not change: too large for
// the topic or the client, an invalid topic name, no permission to write the
// topic, a record the topic's policy rejects. Everything else (brokers down,
// timeouts, leadership moves, a topic still being created) is transient. A
// missing cluster-level permission (ClusterAuthorizationFailed, e.g. for
// idempotent writes) concerns the relay, not a row: it is transient too, and
// the relay backs off with its error in the log rather than parking every row.
func permanent(err error) bool {
	for _, e := range []error{kerr.MessageTooLarge, kerr.RecordListTooLarge, kerr.InvalidTopicException,
		kerr.TopicAuthorizationFailed, kerr.InvalidRecord, kerr.PolicyViolation} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// Refuse returns why the client or any broker would refuse rec for good,
// checked before producing: kgo fails a record over its batch limit without
// sending it, and would send the next record of the same key regardless.
func (p kafkaPublisher) Refuse(rec *kgo.Record) error {
	if err := ValidateTopic(rec.Topic); err != nil {
		return fmt.Errorf("%w: %v", kerr.InvalidTopicException, err)
	}
	// A single record's batch: the 61-byte batch header, and generous
	// varint framing for the record and each header.
	size := recordBytes(rec) + 61 + 64 + 10*int64(len(rec.Headers))
	limit := int64(maxBatchBytes(p.cl, rec.Topic))
	if size > limit {
		return fmt.Errorf("%w: a record of %d bytes (key, value and headers) does not fit the producer's batch limit of %d bytes",
			kerr.MessageTooLarge, recordBytes(rec), limit)
	}
	return nil
}

// maxBatchBytes is the client's batch size limit for topic: the smaller of
// ProducerBatchMaxBytes and BrokerMaxWriteBytes less a produce request's
// framing (at most 300 bytes with a 249-byte topic name).
func maxBatchBytes(cl *kgo.Client, topic string) int32 {
	limit := int32(1_000_012) // kgo's default, Kafka's default max.message.bytes
	if fn, ok := cl.OptValue(kgo.ProducerBatchMaxBytesFn).(func(string) int32); ok && fn != nil {
		limit = fn(topic)
	}
	if w, ok := cl.OptValue(kgo.BrokerMaxWriteBytes).(int32); ok && w-300 < limit {
		limit = w - 300
	}
	if b, ok := cl.OptValue(kgo.MaxBufferedBytes).(int64); ok && b > 0 && b < int64(limit) {
		limit = int32(b)
	}
	return limit
}

// recordBytes is rec's key, value and header bytes.
func recordBytes(rec *kgo.Record) int64 {
	n := len(rec.Key) + len(rec.Value)
	for _, h := range rec.Headers {
		n += len(h.Key) + len(h.Value)
	}
	return int64(n)
}

func keyOf(rec *kgo.Record) string { return rec.Topic + "\x00" + string(rec.Key) }

// startSend starts rec's "send <topic>" PRODUCER span as a child of the
// enqueuer's context (stored in the row's traceparent header) and makes the
// record carry the send span's context instead.
func (r *Relay) startSend(ctx context.Context, system attribute.KeyValue, rec *kgo.Record) trace.Span {
	if parent := telemetry.Extract(rec.Headers); parent.IsValid() {
		ctx = trace.ContextWithRemoteSpanContext(ctx, parent)
	}
	ctx, span := r.tracer.Start(ctx, "send "+rec.Topic, trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(
		system, telemetry.MessagingDestination.String(rec.Topic),
		telemetry.MessagingOperationType.String("send"), telemetry.MessagingOperationName.String("send"),
		telemetry.MessagingMessageID.String((telemetry.Carrier{Headers: &rec.Headers}).Get(MessageIDHeader))))
	if span.SpanContext().IsValid() {
		telemetry.Inject(ctx, &rec.Headers)
	}
	return span
}

// listen turns NOTIFYs on the outbox channel into wake-ups, on a dedicated
// connection, reconnecting with backoff. Polling covers any gap.
func (r *Relay) listen(ctx context.Context, wake chan<- struct{}) {
	for n := 1; ctx.Err() == nil; n++ {
		err := r.listenOnce(ctx, wake)
		if ctx.Err() != nil {
			return
		}
		r.outage.Warn(ctx, "oncely outbox: notification listener failed; polling meanwhile", "err", err)
		debounce(ctx, r.backoff.Delay(n))
	}
}

func (r *Relay) listenOnce(ctx context.Context, wake chan<- struct{}) error {
	conn, err := pgx.ConnectConfig(ctx, r.cfg.Pool.Config().ConnConfig.Copy())
	if err != nil {
		return err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{r.outbox.channel}.Sanitize()); err != nil {
		return err
	}
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return err
		}
		select {
		case wake <- struct{}{}:
		default:
		}
	}
}

// cleanup deletes sent rows past the retention every CleanupInterval.
func (r *Relay) cleanup(ctx context.Context) {
	t := time.NewTicker(r.cfg.CleanupInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n, err := r.outbox.DeleteSent(ctx, r.cfg.Pool, r.cfg.Retention, r.cfg.CleanupBatch)
		r.deleted.Add(n)
		if err != nil && ctx.Err() == nil {
			r.outage.Warn(ctx, "oncely outbox: retention cleanup failed", "err", err)
		}
	}
}
