package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/oncely/oncely/internal/backoff"
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
	// Brokers are the seed brokers. Required.
	Brokers []string
	// ClientOpts are extra franz-go options (TLS, SASL...).
	ClientOpts []kgo.Opt

	// BatchSize bounds the rows published per shard transaction. Default 500.
	BatchSize int
	// PollInterval is the fallback wake-up when no notification arrives.
	// Default 1s.
	PollInterval time.Duration
	// NotifyDebounce gathers notifications arriving close together into
	// one wake-up. Default 5ms.
	NotifyDebounce time.Duration
	// ProduceTimeout bounds one batch's produce (at least 1s). Default 10s.
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
	pending metric.Int64ObservableGauge
	oldest  metric.Float64ObservableGauge

	published, batches, produceErrs, deleted atomic.Int64
	running, dbDown                          atomic.Bool
}

type relayQueries struct {
	shards, lock, selectBatch, markSent string
}

// RelayStats are a relay's counters.
type RelayStats struct {
	Published     int64 // rows published and marked sent
	Batches       int64 // shard transactions that published rows
	ProduceErrors int64 // failed batch produces (rows stayed pending)
	Deleted       int64 // sent rows removed by retention
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
	case len(cfg.Brokers) == 0:
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
	if err := errors.Join(err1, err2, err3); err != nil {
		return nil, fmt.Errorf("outbox: metrics: %w", err)
	}
	return &Relay{
		cfg: cfg, outbox: o,
		tracer: telemetry.Tracer(cfg.TracerProvider), meter: meter, sent: sent, pending: pending, oldest: oldest,
		backoff: backoff.Policy{Base: cfg.RetryBaseDelay, Max: cfg.RetryMaxDelay},
		q: relayQueries{
			shards: `SELECT shard FROM ` + t + ` WHERE sent_at IS NULL GROUP BY shard`,
			lock:   `SELECT pg_try_advisory_xact_lock(hashtext($1), $2)`,
			selectBatch: `SELECT id, message_id, topic, key, value, header_keys, header_values FROM ` + t + `
				WHERE shard = $1 AND sent_at IS NULL ORDER BY id LIMIT $2`,
			markSent: `UPDATE ` + t + ` SET sent_at = now() WHERE id = ANY($1)`,
		},
	}, nil
}

// Stats returns the relay's counters.
func (r *Relay) Stats() RelayStats {
	return RelayStats{Published: r.published.Load(), Batches: r.batches.Load(),
		ProduceErrors: r.produceErrs.Load(), Deleted: r.deleted.Load()}
}

// Ready reports whether Run is publishing and the database answered the
// relay's most recent query (it asks at least every PollInterval). Use it
// for readiness probes: while the database is unreachable the relay
// publishes nothing, and its rows wait in the outbox.
func (r *Relay) Ready() bool { return r.running.Load() && !r.dbDown.Load() }

// Run publishes until ctx is done, then returns nil after the batch in
// flight (bounded by ProduceTimeout). It may be called once.
func (r *Relay) Run(ctx context.Context) error {
	if !r.started.CompareAndSwap(false, true) {
		return errors.New("outbox: Relay.Run called more than once")
	}
	cl, err := kgo.NewClient(append([]kgo.Opt{
		kgo.SeedBrokers(r.cfg.Brokers...),
		kgo.RequiredAcks(kgo.AllISRAcks()), // idempotent by default
		kgo.RecordDeliveryTimeout(r.cfg.ProduceTimeout),
		kgo.ProducerLinger(0),
	}, r.cfg.ClientOpts...)...)
	if err != nil {
		return fmt.Errorf("outbox: kafka client: %w", err)
	}
	defer cl.Close()
	r.running.Store(true)
	defer r.running.Store(false)
	hooks := testhook.RelayFrom(ctx)
	if reg, err := r.meter.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		st, err := r.outbox.Status(ctx, r.cfg.Pool)
		if err != nil {
			return err
		}
		attrs := metric.WithAttributes(attribute.String("db.namespace", r.outbox.schema))
		o.ObserveInt64(r.pending, st.Pending, attrs)
		o.ObserveFloat64(r.oldest, st.OldestPending.Seconds(), attrs)
		return nil
	}, r.pending, r.oldest); err == nil {
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

	r.cfg.Logger.Info("oncely outbox relay started", "schema", r.outbox.schema, "shards", r.outbox.shards)
	retryAt := map[int]time.Time{}
	failures := map[int]int{}
	poll := time.NewTimer(0)
	defer poll.Stop()
	for {
		busy, next, crash := r.cycle(ctx, cl, hooks, retryAt, failures)
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
func (r *Relay) cycle(ctx context.Context, cl *kgo.Client, hooks *testhook.Relay, retryAt map[int]time.Time, failures map[int]int) (busy bool, next time.Time, crash error) {
	rows, err := r.cfg.Pool.Query(ctx, r.q.shards)
	var shards []int
	if err == nil {
		shards, err = pgx.CollectRows(rows, pgx.RowTo[int])
	}
	if err != nil {
		if ctx.Err() == nil {
			r.dbDown.Store(true)
			r.cfg.Logger.Warn("oncely outbox: reading pending shards failed", "err", err)
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
		n, err := r.publishShard(ctx, cl, hooks, shard)
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
			r.cfg.Logger.Warn("oncely outbox: publishing shard failed; rows stay pending", "shard", shard,
				"attempt", failures[shard], "retry_at", at, "err", err)
			continue
		}
		delete(retryAt, shard)
		delete(failures, shard)
		busy = busy || n == r.cfg.BatchSize
	}
	return busy, next, nil
}

// publishShard publishes up to BatchSize pending rows of shard in id order,
// holding the shard's advisory lock, and marks them sent in the same
// transaction after the broker acknowledged them. It returns 0 when another
// relay holds the shard.
func (r *Relay) publishShard(ctx context.Context, cl *kgo.Client, hooks *testhook.Relay, shard int) (int, error) {
	tx, err := r.cfg.Pool.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = tx.Rollback(rctx)
	}()
	// A relay cut off from Postgres must not hold the shard forever.
	idle := strconv.FormatInt((2 * r.cfg.ProduceTimeout).Milliseconds(), 10)
	if _, err := tx.Exec(ctx, `SELECT set_config('idle_in_transaction_session_timeout', $1, true)`, idle); err != nil {
		return 0, err
	}
	var locked bool
	if err := tx.QueryRow(ctx, r.q.lock, "oncely.outbox."+r.outbox.schema, shard).Scan(&locked); err != nil {
		return 0, err
	}
	if !locked {
		return 0, nil
	}
	rows, err := tx.Query(ctx, r.q.selectBatch, shard, r.cfg.BatchSize)
	if err != nil {
		return 0, err
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
		return 0, err
	}
	spans := make([]trace.Span, len(recs))
	for i, rec := range recs {
		spans[i] = r.startSend(ctx, rec)
	}
	pctx, cancel := context.WithTimeout(ctx, r.cfg.ProduceTimeout)
	results := cl.ProduceSync(pctx, recs...)
	cancel()
	for i, res := range results {
		attrs := []attribute.KeyValue{telemetry.Kafka, telemetry.MessagingDestination.String(recs[i].Topic)}
		if res.Err != nil {
			telemetry.Fail(spans[i], res.Err, "produce")
			attrs = append(attrs, telemetry.ErrorType.String("produce"))
		} else {
			spans[i].SetAttributes(telemetry.MessagingPartition.String(strconv.FormatInt(int64(res.Record.Partition), 10)),
				telemetry.MessagingKafkaOffset.Int64(res.Record.Offset))
		}
		spans[i].End()
		r.sent.Add(ctx, 1, metric.WithAttributes(attrs...))
	}
	if err := results.FirstErr(); err != nil {
		r.produceErrs.Add(1)
		return 0, fmt.Errorf("produce %d records: %w", len(recs), err)
	}
	if h := hooks.AfterProduce; h != nil {
		if err := h(len(recs)); err != nil {
			return 0, err
		}
	}
	if _, err := tx.Exec(ctx, r.q.markSent, ids); err != nil {
		return 0, fmt.Errorf("mark sent: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("commit: %w", err)
	}
	r.published.Add(int64(len(recs)))
	r.batches.Add(1)
	return len(recs), nil
}

// startSend starts rec's "send <topic>" PRODUCER span as a child of the
// enqueuer's context (stored in the row's traceparent header) and makes the
// record carry the send span's context instead.
func (r *Relay) startSend(ctx context.Context, rec *kgo.Record) trace.Span {
	if parent := telemetry.Extract(rec.Headers); parent.IsValid() {
		ctx = trace.ContextWithRemoteSpanContext(ctx, parent)
	}
	ctx, span := r.tracer.Start(ctx, "send "+rec.Topic, trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(
		telemetry.Kafka, telemetry.MessagingDestination.String(rec.Topic),
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
		r.cfg.Logger.Warn("oncely outbox: notification listener failed; polling meanwhile", "err", err)
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
			r.cfg.Logger.Warn("oncely outbox: retention cleanup failed", "err", err)
		}
	}
}
