package natsconsumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/backoff"
	"github.com/oncely/oncely/internal/brokersource"
	"github.com/oncely/oncely/internal/ratelog"
	"github.com/oncely/oncely/internal/testhook"
)

// Provenance headers of a dead-letter message, beside the oncely-dlq-*
// headers of package dlq (group, message id, attempts, failure times, error
// class, error, trace context; its topic and offset headers hold the
// subject and the stream sequence).
const (
	HeaderStream        = dlq.Prefix + "stream"         // the stream the message was stored in
	HeaderSubject       = dlq.Prefix + "subject"        // the subject it was published to
	HeaderSequence      = dlq.Prefix + "sequence"       // its stream sequence, decimal
	HeaderDeliveryCount = dlq.Prefix + "delivery-count" // JetStream's delivery count of the last delivery, decimal
	HeaderConsumer      = dlq.Prefix + "consumer"       // the durable consumer that gave up
)

// System is the messaging.system of spans and metrics.
const System = "nats"

// Defaults of Config.
const (
	DefaultAckWait     = 30 * time.Second
	DefaultConcurrency = 1
	DefaultMaxAttempts = consumer.DefaultMaxAttempts
	DefaultFetchAhead  = 32
)

// DefaultDeadLetterSubject is Config.DeadLetterSubject when it is nil: the
// message's subject under "dlq.".
func DefaultDeadLetterSubject(subject string) string { return "dlq." + subject }

// Config configures a Consumer. Stream, Durable, Pool and Handler are
// required.
type Config struct {
	// JetStream is the JetStream context of a connection the caller owns
	// (jetstream.New(nc)). Required.
	JetStream jetstream.JetStream
	// Stream is the stream to consume. Required; it must exist.
	Stream string
	// Durable names the durable pull consumer, created or updated by Run,
	// and is the inbox's consumer group: two Durables process the same
	// message independently. Required.
	Durable string
	// FilterSubjects restricts the consumer to these subjects (wildcards
	// allowed). Default: every subject of the stream.
	FilterSubjects []string

	Pool   *pgxpool.Pool
	Schema string // default "oncely"

	// Handler runs once per new message id, inside the transaction that
	// claimed it. Message.Topic is the subject, Message.Offset the stream
	// sequence, Message.Attempt the delivery count. Required unless
	// BatchHandler is set.
	Handler consumer.Handler

	// BatchSize above 1 turns on batch mode: up to BatchSize messages,
	// fetched with one pull request, share one transaction. Their ids are
	// claimed in the inbox with one multi-row statement; with Handler,
	// each new message runs under a savepoint of its own, so a failing
	// message rolls back alone and, once the others committed, is retried
	// (NakWithDelay) or dead-lettered on its own. After the COMMIT every
	// message of the batch is acknowledged. A batch takes the messages the stream
	// has ready; it never waits for more. Default 1: a transaction per
	// message.
	BatchSize int
	// BatchHandler, when set with BatchSize above 1, receives all new
	// messages of a batch at once instead of Handler running per message.
	BatchHandler consumer.BatchHandler

	// MessageIDHeader is the header read for the dedup id when the
	// message has no Nats-Msg-Id. Default "message-id". A message with
	// neither is deduplicated by "<stream>/<sequence>", which catches
	// redeliveries but not a producer's duplicate.
	MessageIDHeader string

	// MaxAttempts is how many deliveries a failing message gets before it
	// is dead-lettered; JetStream's delivery count is the attempt count, so
	// deliveries that ended with a crash count too. The consumer's
	// MaxDeliver is MaxAttempts+1: the extra delivery, which comes only
	// when none of the others reached a verdict, dead-letters the message
	// (class crash_loop) without running it. Default 10.
	MaxAttempts int
	// RetryBaseDelay and RetryMaxDelay bound the NakWithDelay backoff
	// (exponential, full jitter). Defaults 100ms and 30s.
	RetryBaseDelay, RetryMaxDelay time.Duration
	// AckWait is the consumer's AckWait: a delivery not acknowledged in
	// that time is delivered again. A message in progress is kept with
	// InProgress every AckWait/3. Default 30s.
	AckWait time.Duration
	// Concurrency is how many messages (batches, in batch mode) run at
	// once, each in its own transaction. The consumer's MaxAckPending is
	// twice what the process may hold: Concurrency x BatchSize +
	// FetchAhead. Default 1.
	Concurrency int
	// FetchAhead is how many messages, without batches, are fetched ahead
	// of the Concurrency running ones, to wait for a free slot: a fetch is
	// a round trip, and brings up to that many at once. A fetched message
	// is kept from redelivery (InProgress) while it waits, and a graceful
	// stop runs it; a crash counts a delivery for it as for the running
	// ones. Default 32; negative: none.
	FetchAhead int
	// DeadLetterSubject names the subject a message's dead-letter copy is
	// published to; a stream must capture it (Run fails at start-up when
	// none captures the subject that the Stream's first subject maps to).
	// Default DefaultDeadLetterSubject.
	DeadLetterSubject func(subject string) string
	// ShutdownTimeout bounds how long Run waits for messages in progress
	// when asked to stop. Default 30s.
	ShutdownTimeout time.Duration

	Logger         *slog.Logger
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider
	// UntrustedProducers makes each process span a new root, linked to the
	// producer's trace context instead of parented to it.
	UntrustedProducers bool
}

// ErrInvalidConfig is wrapped by New's errors, which name the field.
var ErrInvalidConfig = consumer.ErrInvalidConfig

// Consumer is a durable JetStream pull consumer whose handler's effects
// happen once per (Durable, message id). Create it with New and run it with
// Run.
type Consumer struct {
	cfg     Config
	path    *consumer.Consumer
	live    atomic.Pointer[run] // the running Run, for NotReady
	backoff backoff.Policy
	// outage writes the warnings that repeat while NATS is unreachable,
	// at most one of a kind a minute.
	outage *ratelog.Limiter
}

// New validates cfg and returns a Consumer.
func New(cfg Config) (*Consumer, error) {
	cfg.MaxAttempts = cmp.Or(cfg.MaxAttempts, DefaultMaxAttempts)
	cfg.AckWait = cmp.Or(cfg.AckWait, DefaultAckWait)
	cfg.Concurrency = cmp.Or(cfg.Concurrency, DefaultConcurrency)
	cfg.BatchSize = cmp.Or(cfg.BatchSize, 1)
	cfg.FetchAhead = cmp.Or(cfg.FetchAhead, DefaultFetchAhead)
	if cfg.FetchAhead < 0 || cfg.BatchSize > 1 {
		cfg.FetchAhead = 0
	}
	cfg.ShutdownTimeout = cmp.Or(cfg.ShutdownTimeout, 30*time.Second)
	cfg.RetryBaseDelay = cmp.Or(cfg.RetryBaseDelay, 100*time.Millisecond)
	cfg.RetryMaxDelay = cmp.Or(cfg.RetryMaxDelay, 30*time.Second)
	cfg.MessageIDHeader = cmp.Or(cfg.MessageIDHeader, dlq.HeaderMessageIDDefault)
	if cfg.DeadLetterSubject == nil {
		cfg.DeadLetterSubject = DefaultDeadLetterSubject
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	invalid := func(field, format string, args ...any) error {
		return fmt.Errorf("%w: %s: %s", ErrInvalidConfig, field, fmt.Sprintf(format, args...))
	}
	switch {
	case cfg.JetStream == nil:
		return nil, invalid("JetStream", "a jetstream.JetStream is required")
	case cfg.Stream == "":
		return nil, invalid("Stream", "a stream name is required")
	case cfg.Durable == "" || strings.ContainsAny(cfg.Durable, ".*> \t"):
		return nil, invalid("Durable", "a durable name without '.', '*', '>' or spaces is required, got %q", cfg.Durable)
	case cfg.Concurrency < 1:
		return nil, invalid("Concurrency", "must be at least 1, got %d", cfg.Concurrency)
	case cfg.BatchSize < 1:
		return nil, invalid("BatchSize", "must be at least 1, got %d", cfg.BatchSize)
	case cfg.AckWait < time.Second:
		return nil, invalid("AckWait", "must be at least 1s, got %s", cfg.AckWait)
	case cfg.ShutdownTimeout < 0:
		return nil, invalid("ShutdownTimeout", "must not be negative, got %s", cfg.ShutdownTimeout)
	}
	stream := cfg.Stream
	idHeader := cfg.MessageIDHeader
	path, err := consumer.NewRecordPath(consumer.Config{
		Group: cfg.Durable, Pool: cfg.Pool, Schema: cfg.Schema, Handler: cfg.Handler,
		BatchSize: cfg.BatchSize, BatchHandler: cfg.BatchHandler,
		// Nats-Msg-Id, then MessageIDHeader, then the stream sequence.
		KeyFunc: func(rec *kgo.Record) (string, error) {
			if id := header(rec, nats.MsgIdHdr); id != "" {
				return id, nil
			}
			if id := header(rec, idHeader); id != "" {
				return id, nil
			}
			return stream + "/" + strconv.FormatInt(rec.Offset, 10), nil
		},
		MessageIDHeader: idHeader, MaxAttempts: cfg.MaxAttempts,
		RetryBaseDelay: cfg.RetryBaseDelay, RetryMaxDelay: cfg.RetryMaxDelay,
		DeadLetterTopic: cfg.DeadLetterSubject,
		Logger:          cfg.Logger, TracerProvider: cfg.TracerProvider, MeterProvider: cfg.MeterProvider,
		UntrustedProducers: cfg.UntrustedProducers,
	}, System)
	if err != nil {
		return nil, err
	}
	return &Consumer{cfg: cfg, path: path, backoff: backoff.Policy{Base: cfg.RetryBaseDelay, Max: cfg.RetryMaxDelay},
		outage: ratelog.New(cfg.Logger, time.Minute)}, nil
}

// Stats returns the record path's counters (OffsetCommits and
// PartitionsHeld stay 0, Concurrency is the record path's Config.Concurrency,
// which this consumer does not use; CrashLoops counts messages dead-lettered after
// MaxAttempts deliveries that none finished).
func (c *Consumer) Stats() consumer.Stats { return c.path.Stats() }

// Ready reports whether Run is consuming: its connection is up, its last
// fetch succeeded, the last attempt reached the database, and the last
// dead-letter publish (if any failed) succeeded since. Use it for
// readiness probes; NotReady says why it is false.
func (c *Consumer) Ready() bool { return c.NotReady() == "" }

// NotReady says why Ready is false, for a readiness probe's answer; "" when
// it is true.
func (c *Consumer) NotReady() string {
	r := c.live.Load()
	if r == nil || r.stopping.Load() || r.pollCtx.Err() != nil {
		return "not consuming (starting, stopped or failed)"
	}
	var reasons []string
	if st := c.cfg.JetStream.Conn().Status(); st != nats.CONNECTED {
		reasons = append(reasons, "NATS connection "+strings.ToLower(st.String()))
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.fetchErr != "" {
		reasons = append(reasons, fmt.Sprintf("fetching from stream %s fails: %s", c.cfg.Stream, r.fetchErr))
	}
	if r.dbDown {
		reasons = append(reasons, "waits for the database")
	}
	if r.dlqErr != "" {
		reasons = append(reasons, "waits for its dead-letter subject: "+r.dlqErr)
	}
	return strings.Join(reasons, "; ")
}

// deadLetterDown records whether the last dead-letter publish failed, and
// why.
func (r *run) deadLetterDown(why string) {
	r.mu.Lock()
	r.dlqErr = why
	r.mu.Unlock()
}

// header returns the first non-empty header named key, in any casing.
func header(rec *kgo.Record, key string) string {
	for _, h := range rec.Headers {
		if len(h.Value) > 0 && strings.EqualFold(h.Key, key) {
			return string(h.Value)
		}
	}
	return ""
}

// Run creates or updates the durable consumer and processes messages until
// ctx is cancelled; then it finishes the messages in progress (bounded by
// ShutdownTimeout) and returns nil. It fails at start-up when the inbox
// table is missing (consumer.ErrNotMigrated), the stream does not exist, or
// no stream captures the dead-letter subject.
func (c *Consumer) Run(ctx context.Context) error {
	if err := c.path.CheckSchema(ctx); err != nil {
		return err
	}
	js := c.cfg.JetStream
	stream, err := js.Stream(ctx, c.cfg.Stream)
	if err != nil {
		return fmt.Errorf("natsconsumer: stream %q: %w", c.cfg.Stream, err)
	}
	if subjects := stream.CachedInfo().Config.Subjects; len(subjects) > 0 {
		probe := c.cfg.DeadLetterSubject(strings.NewReplacer("*", "x", ">", "x").Replace(subjects[0]))
		if _, err := js.StreamNameBySubject(ctx, probe); err != nil {
			return fmt.Errorf("natsconsumer: no stream captures the dead-letter subject %q (DeadLetterSubject): %w", probe, err)
		}
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, c.cfg.Stream, jetstream.ConsumerConfig{
		Durable:        c.cfg.Durable,
		AckPolicy:      jetstream.AckExplicitPolicy,
		AckWait:        c.cfg.AckWait,
		MaxDeliver:     c.cfg.MaxAttempts + 1,
		MaxAckPending:  2 * (c.cfg.Concurrency*c.cfg.BatchSize + c.cfg.FetchAhead),
		FilterSubjects: c.cfg.FilterSubjects,
		DeliverPolicy:  jetstream.DeliverAllPolicy,
	})
	if err != nil {
		return fmt.Errorf("natsconsumer: consumer %q on stream %q: %w", c.cfg.Durable, c.cfg.Stream, err)
	}
	r := &run{c: c, hooks: testhook.ConsumerFrom(ctx), cons: cons, held: map[jetstream.Msg]struct{}{}}
	// In-progress messages survive ctx, for the drain; workCtx ends them.
	workCtx, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	r.workCtx = workCtx
	pollCtx, cancelPoll := context.WithCancelCause(ctx)
	defer cancelPoll(nil)
	r.cancelPoll = cancelPoll
	r.pollCtx = pollCtx
	c.live.Store(r)
	defer c.live.CompareAndSwap(r, nil)
	c.cfg.Logger.Info("oncely nats consumer started", "stream", c.cfg.Stream, "durable", c.cfg.Durable,
		"batch_size", c.cfg.BatchSize)

	var wg sync.WaitGroup
	keepCtx, stopKeeping := context.WithCancel(workCtx)
	defer stopKeeping()
	go r.keepInProgress(keepCtx)
	if c.cfg.BatchSize > 1 {
		r.pollBatches(&wg)
	} else {
		r.pollMessages(&wg)
	}
	r.stopping.Store(true)
	brokersource.Drain(&wg, c.cfg.ShutdownTimeout, cancelWork)
	r.confirmAcks()
	// The outbox wake-ups that the last commits owe.
	c.path.WaitWakeUps(context.WithoutCancel(ctx))
	// pollCtx ended on its own cause only through fail.
	if err := brokersource.StopError(ctx, pollCtx); err != nil {
		c.cfg.Logger.Error("oncely nats consumer stopped", "err", err)
		return err
	}
	c.cfg.Logger.Info("oncely nats consumer stopped", "stream", c.cfg.Stream, "durable", c.cfg.Durable)
	return nil
}

// pollMessages runs Concurrency workers, each on one message at a time,
// and fetches ahead of them: up to FetchAhead more messages wait, fetched,
// for a free worker, so that no worker waits for a fetch's round trip while
// the stream has messages, and a fetch brings FetchAhead/2 or more. A message is kept from redelivery (InProgress)
// from the moment it is fetched. On the way out the workers finish the
// messages fetched.
func (r *run) pollMessages(wg *sync.WaitGroup) {
	c, pollCtx := r.c, r.pollCtx
	held := c.cfg.Concurrency + c.cfg.FetchAhead
	slots := make(chan struct{}, held) // a message fetched and not finished holds one
	queue := make(chan jetstream.Msg, held)
	for range c.cfg.Concurrency {
		wg.Go(func() {
			for m := range queue {
				r.handle(m)
				r.release(m)
				<-slots
			}
		})
	}
	defer close(queue)
	// A fetch waits for half the room ahead to be free: while the other
	// half waits for the workers, one round trip brings several messages.
	want := max(1, c.cfg.FetchAhead/2)
	for pollCtx.Err() == nil {
		free := 0
	wait:
		for free < want {
			select {
			case slots <- struct{}{}:
				free++
			case <-pollCtx.Done():
				break wait
			}
		}
		if pollCtx.Err() != nil {
			for range free {
				<-slots
			}
			break
		}
		for free < held {
			select {
			case slots <- struct{}{}:
				free++
				continue
			default:
			}
			break
		}
		batch, err := r.cons.Fetch(free, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			for range free {
				<-slots
			}
			r.fetchFailed(err)
			continue
		}
		got := 0
		for m := range batch.Messages() {
			got++
			r.hold(m)
			queue <- m
		}
		for range free - got {
			<-slots
		}
		if err := batchErr(batch); err != nil && pollCtx.Err() == nil {
			r.fetchFailed(err)
		} else {
			r.fetched()
		}
	}
}

// pollBatches fetches a batch of up to BatchSize messages for each free
// slot and runs it in a goroutine of its own, until the poll context ends.
func (r *run) pollBatches(wg *sync.WaitGroup) {
	c, pollCtx := r.c, r.pollCtx
	slots := make(chan struct{}, c.cfg.Concurrency)
	for {
		select {
		case slots <- struct{}{}:
		case <-pollCtx.Done():
			return
		}
		msgs, err := r.fetchBatch(c.cfg.BatchSize)
		if len(msgs) == 0 {
			<-slots
		} else {
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() { <-slots }()
				r.handleBatch(msgs)
			}()
		}
		if err != nil && pollCtx.Err() == nil {
			r.fetchFailed(err)
		} else if err == nil {
			r.fetched()
		}
	}
}

// fetchBatch takes up to n messages: those the consumer has ready at once
// (FetchNoWait); when it has none, the first to arrive within a second and
// those ready behind it. A batch thus never waits to fill up: a message
// that arrives alone runs at once, and a backlog runs n at a time. Messages
// are returned even with an error, which is the fetch's that came after
// them.
func (r *run) fetchBatch(n int) ([]jetstream.Msg, error) {
	msgs, err := collect(r.cons.FetchNoWait(n))
	if err != nil || len(msgs) > 0 {
		return msgs, err
	}
	msgs, err = collect(r.cons.Fetch(1, jetstream.FetchMaxWait(time.Second)))
	if err != nil || len(msgs) == 0 || n == 1 {
		return msgs, err
	}
	more, err := collect(r.cons.FetchNoWait(n - 1))
	return append(msgs, more...), err
}

// collect returns a fetch's messages and its error, if any other than the
// end of its wait.
func collect(batch jetstream.MessageBatch, err error) ([]jetstream.Msg, error) {
	if err != nil {
		return nil, err
	}
	var msgs []jetstream.Msg
	for m := range batch.Messages() {
		msgs = append(msgs, m)
	}
	return msgs, batchErr(batch)
}

// batchErr is a fetch's error, unless it only says that its wait ended.
func batchErr(batch jetstream.MessageBatch) error {
	if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return nil
}

// fetchFailed records a failed fetch, for NotReady, and waits a second
// before the next.
func (r *run) fetchFailed(err error) {
	r.mu.Lock()
	r.fetchErr = err.Error()
	r.mu.Unlock()
	r.c.outage.Warn(r.pollCtx, "oncely nats fetch failed; retrying", "stream", r.c.cfg.Stream, "err", err)
	sleep(r.pollCtx, time.Second)
}

// fetched records that a fetch succeeded.
func (r *run) fetched() {
	r.mu.Lock()
	r.fetchErr = ""
	r.mu.Unlock()
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

// run is the state of one Run call.
type run struct {
	c       *Consumer
	hooks   *testhook.Consumer
	cons    jetstream.Consumer
	workCtx context.Context // ends the messages in progress (ShutdownTimeout)
	pollCtx context.Context // ends the fetching
	// cancelPoll ends the fetching with a cause that Run returns.
	cancelPoll context.CancelCauseFunc
	// crashed: a test's crash point stopped the run; nothing more is
	// acknowledged.
	crashed  atomic.Bool
	stopping atomic.Bool // Run is draining: not ready

	heldMu sync.Mutex
	held   map[jetstream.Msg]struct{} // fetched and not finished: see keepInProgress

	mu       sync.Mutex
	fetchErr string // the last fetch failed: why ("" once one succeeded)
	dbDown   bool   // the last attempt could not reach the database
	dlqErr   string // the last dead-letter publish failed: why ("" once one succeeded)
}

// fail stops Run, which returns err: a simulated crash.
func (r *run) fail(err error) {
	r.crashed.Store(true)
	r.cancelPoll(err)
}

// handle runs one delivery through the record path.
func (r *run) handle(m jetstream.Msg) {
	c := r.c
	md, err := m.Metadata()
	if err != nil {
		// Not a JetStream delivery (no ack reply): nothing to settle.
		c.cfg.Logger.Error("oncely nats message without JetStream metadata; skipped", "subject", m.Subject(), "err", err)
		return
	}
	ctx, cancel := context.WithCancel(r.workCtx)
	defer cancel()
	src := &source{r: r, m: m, md: md, ctx: ctx}
	c.path.Deliver(ctx, record(m, md), src)
}

// handleBatch runs a batch of deliveries through the record path's batch
// mode (consumer.DeliverBatch): one transaction, a savepoint per message;
// each message is acknowledged after the COMMIT.
func (r *run) handleBatch(msgs []jetstream.Msg) {
	c := r.c
	ctx, cancel := context.WithCancel(r.workCtx)
	defer cancel()
	r.hold(msgs...)
	defer r.release(msgs...)
	recs := make([]*kgo.Record, 0, len(msgs))
	srcs := make([]consumer.Source, 0, len(msgs))
	for _, m := range msgs {
		md, err := m.Metadata()
		if err != nil {
			c.cfg.Logger.Error("oncely nats message without JetStream metadata; skipped", "subject", m.Subject(), "err", err)
			continue
		}
		recs = append(recs, record(m, md))
		srcs = append(srcs, &source{r: r, m: m, md: md, ctx: ctx})
	}
	c.path.DeliverBatch(ctx, recs, srcs)
}

// confirmAcks waits until the server has read the acknowledgements sent so
// far on the connection (a PING sent after them, answered): Run's last
// step, so that a process that exits after Run returned has not left its
// last acks unsent in a buffer. Only a lost connection keeps an ack from
// the server, and then JetStream delivers the message again after AckWait;
// the inbox recognises it.
func (r *run) confirmAcks() {
	if r.crashed.Load() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := r.c.cfg.JetStream.Conn().FlushWithContext(ctx); err != nil {
		r.c.cfg.Logger.Warn("oncely nats acknowledgements unconfirmed at shutdown; unacknowledged messages come again and are skipped as duplicates",
			"stream", r.c.cfg.Stream, "err", err)
	}
}

// hold adds msgs to the messages the run keeps from redelivery while they
// wait or run (see keepInProgress).
func (r *run) hold(msgs ...jetstream.Msg) {
	r.heldMu.Lock()
	for _, m := range msgs {
		r.held[m] = struct{}{}
	}
	r.heldMu.Unlock()
}

// release ends hold for msgs.
func (r *run) release(msgs ...jetstream.Msg) {
	r.heldMu.Lock()
	for _, m := range msgs {
		delete(r.held, m)
	}
	r.heldMu.Unlock()
}

// keepInProgress sends InProgress for every message held, every
// AckWait/3, until ctx ends: a message waiting for a worker or running
// longer than AckWait is not delivered again meanwhile. One loop for all
// messages: the per-message cost is a map insert and delete.
func (r *run) keepInProgress(ctx context.Context) {
	t := time.NewTicker(r.c.cfg.AckWait / 3)
	defer t.Stop()
	var msgs []jetstream.Msg
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		r.heldMu.Lock()
		msgs = msgs[:0]
		for m := range r.held {
			msgs = append(msgs, m)
		}
		r.heldMu.Unlock()
		for _, m := range msgs {
			_ = m.InProgress() // a settled message's is not sent
		}
	}
}

// record is m as the record path sees it: Topic the subject, Offset the
// stream sequence, the headers in key order.
func record(m jetstream.Msg, md *jetstream.MsgMetadata) *kgo.Record {
	rec := &kgo.Record{Topic: m.Subject(), Offset: int64(md.Sequence.Stream), Value: m.Data(), Timestamp: md.Timestamp}
	hdr := m.Headers()
	keys := make([]string, 0, len(hdr))
	for k := range hdr {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		for _, v := range hdr[k] {
			rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: k, Value: []byte(v)})
		}
	}
	return rec
}

// source is one JetStream delivery as a consumer.Source.
type source struct {
	r   *run
	m   jetstream.Msg
	md  *jetstream.MsgMetadata
	ctx context.Context
}

// Spent: the deliveries before this one, each an attempt.
func (s *source) Spent() int { return int(s.md.NumDelivered) - 1 }

// Pause waits d; false once the attempt's context ends.
func (s *source) Pause(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-s.ctx.Done():
		return false
	}
}

// Retry hands the message back: JetStream delivers it again after delay,
// with its delivery count one higher.
func (s *source) Retry(_ context.Context, delay time.Duration) bool {
	if err := s.m.NakWithDelay(delay); err != nil {
		// Unacknowledged, it comes back after AckWait all the same.
		s.r.c.cfg.Logger.Warn("oncely nats nak failed; the message returns after AckWait", "subject", s.m.Subject(),
			"sequence", s.md.Sequence.Stream, "err", err)
	}
	return false
}

// DatabaseDown records, for NotReady, whether the database answered.
func (s *source) DatabaseDown(down bool) {
	s.r.mu.Lock()
	s.r.dbDown = down
	s.r.mu.Unlock()
}

// Settle acknowledges a finished message (Ack), or terminates a
// dead-lettered one (Term), after the crash-point hooks; neither waits for
// the server's reply (see confirmAcks). After a simulated crash nothing
// more is settled.
func (s *source) Settle(ctx context.Context, rec *kgo.Record, deadLettered bool) bool {
	if s.r.crashed.Load() {
		return false
	}
	h := s.r.hooks.AfterCommit
	if deadLettered {
		h = s.r.hooks.AfterDeadLetter
	}
	if h != nil {
		if err := h(rec); errors.Is(err, testhook.ErrCrash) {
			s.r.fail(fmt.Errorf("natsconsumer: %w", err))
			return false
		}
	}
	for n := 1; ; n++ {
		var err error
		if deadLettered {
			err = s.m.Term()
		} else {
			err = s.m.Ack()
		}
		if err == nil || errors.Is(err, jetstream.ErrMsgAlreadyAckd) {
			return true
		}
		// A lost acknowledgement is a redelivery, which the inbox
		// recognises; try a few times before leaving it to that.
		if n == 3 || !s.Pause(s.r.c.backoff.Delay(n)) {
			s.r.c.cfg.Logger.Warn("oncely nats acknowledgement failed; the message comes again and is skipped as a duplicate",
				"subject", s.m.Subject(), "sequence", s.md.Sequence.Stream, "err", err)
			return false
		}
	}
}

// PublishDeadLetter publishes the dead-letter copy, with its provenance
// headers, to the DeadLetterSubject of the message's subject, and waits for
// the PubAck of the stream that stores it, retrying with backoff meanwhile.
// Its Nats-Msg-Id is stream/sequence/durable: a copy published again after
// a crash before Term is deduplicated within the stream's window.
func (s *source) PublishDeadLetter(ctx context.Context, rec *kgo.Record, info *dlq.Info) bool {
	c := s.r.c
	subject := c.cfg.DeadLetterSubject(rec.Topic)
	return brokersource.Retrier{Backoff: c.backoff, Outage: c.outage}.Publish(ctx, s.Pause, func(pctx context.Context) error {
		out := nats.NewMsg(subject)
		out.Data = rec.Value
		for _, h := range c.path.DeadLetterRecord(ctx, rec, info).Headers {
			out.Header.Add(h.Key, string(h.Value))
		}
		out.Header.Set(HeaderStream, s.md.Stream)
		out.Header.Set(HeaderSubject, rec.Topic)
		out.Header.Set(HeaderSequence, strconv.FormatUint(s.md.Sequence.Stream, 10))
		out.Header.Set(HeaderDeliveryCount, strconv.FormatUint(s.md.NumDelivered, 10))
		out.Header.Set(HeaderConsumer, c.cfg.Durable)
		out.Header.Set(nats.MsgIdHdr, fmt.Sprintf("%s/%d/%s", s.md.Stream, s.md.Sequence.Stream, c.cfg.Durable))
		_, err := c.cfg.JetStream.PublishMsg(pctx, out)
		if err != nil {
			s.r.deadLetterDown(fmt.Sprintf("%s cannot be written: %v", subject, err))
		} else {
			s.r.deadLetterDown("")
		}
		return err
	}, "oncely nats dead-letter publish failed; the message waits", "subject", rec.Topic,
		"sequence", s.md.Sequence.Stream, "dlq_subject", subject)
}
