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
	// sequence, Message.Attempt the delivery count.
	Handler consumer.Handler

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
	// Concurrency is how many messages run at once, each in its own
	// transaction (and the consumer's MaxAckPending is twice it). Default 1.
	Concurrency int
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
	case cfg.AckWait < time.Second:
		return nil, invalid("AckWait", "must be at least 1s, got %s", cfg.AckWait)
	case cfg.ShutdownTimeout < 0:
		return nil, invalid("ShutdownTimeout", "must not be negative, got %s", cfg.ShutdownTimeout)
	}
	stream := cfg.Stream
	idHeader := cfg.MessageIDHeader
	path, err := consumer.NewRecordPath(consumer.Config{
		Group: cfg.Durable, Pool: cfg.Pool, Schema: cfg.Schema, Handler: cfg.Handler,
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
// PartitionsHeld stay 0; CrashLoops counts messages dead-lettered after
// MaxAttempts deliveries that none finished).
func (c *Consumer) Stats() consumer.Stats { return c.path.Stats() }

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
		MaxAckPending:  2 * c.cfg.Concurrency,
		FilterSubjects: c.cfg.FilterSubjects,
		DeliverPolicy:  jetstream.DeliverAllPolicy,
	})
	if err != nil {
		return fmt.Errorf("natsconsumer: consumer %q on stream %q: %w", c.cfg.Durable, c.cfg.Stream, err)
	}
	r := &run{c: c, hooks: testhook.ConsumerFrom(ctx)}
	// In-progress messages survive ctx, for the drain; workCtx ends them.
	workCtx, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	r.workCtx = workCtx
	pollCtx, cancelPoll := context.WithCancelCause(ctx)
	defer cancelPoll(nil)
	r.fail = cancelPoll
	c.cfg.Logger.Info("oncely nats consumer started", "stream", c.cfg.Stream, "durable", c.cfg.Durable)

	slots := make(chan struct{}, c.cfg.Concurrency)
	var wg sync.WaitGroup
	for pollCtx.Err() == nil {
		free := 0
		select {
		case slots <- struct{}{}:
			free = 1
		case <-pollCtx.Done():
		}
		if free == 0 {
			break
		}
		for free < c.cfg.Concurrency {
			select {
			case slots <- struct{}{}:
				free++
				continue
			default:
			}
			break
		}
		batch, err := cons.Fetch(free, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			for range free {
				<-slots
			}
			c.outage.Warn(pollCtx, "oncely nats fetch failed; retrying", "stream", c.cfg.Stream, "err", err)
			sleep(pollCtx, time.Second)
			continue
		}
		got := 0
		for m := range batch.Messages() {
			got++
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() { <-slots }()
				r.handle(m)
			}()
		}
		for range free - got {
			<-slots
		}
		if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, context.DeadlineExceeded) && pollCtx.Err() == nil {
			c.outage.Warn(pollCtx, "oncely nats fetch failed; retrying", "stream", c.cfg.Stream, "err", err)
			sleep(pollCtx, time.Second)
		}
	}
	brokersource.Drain(&wg, c.cfg.ShutdownTimeout, cancelWork)
	// pollCtx ended on its own cause only through fail.
	if err := brokersource.StopError(ctx, pollCtx); err != nil {
		c.cfg.Logger.Error("oncely nats consumer stopped", "err", err)
		return err
	}
	c.cfg.Logger.Info("oncely nats consumer stopped", "stream", c.cfg.Stream, "durable", c.cfg.Durable)
	return nil
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
	workCtx context.Context
	// fail stops Run, which returns its error: a simulated crash.
	fail context.CancelCauseFunc
}

// handle runs one delivery through the record path. While it runs, the
// message is kept from redelivery with InProgress.
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
	keep := make(chan struct{})
	defer close(keep)
	go func() {
		t := time.NewTicker(c.cfg.AckWait / 3)
		defer t.Stop()
		for {
			select {
			case <-keep:
				return
			case <-t.C:
				_ = m.InProgress()
			}
		}
	}()
	src := &source{r: r, m: m, md: md, ctx: ctx}
	c.path.Deliver(ctx, record(m, md), src)
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

func (s *source) DatabaseDown(bool) {}

// Settle acknowledges a finished message (Ack, confirmed by the server), or
// terminates a dead-lettered one (Term), after the crash-point hooks.
func (s *source) Settle(ctx context.Context, rec *kgo.Record, deadLettered bool) bool {
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
			err = s.m.DoubleAck(ctx)
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
		return err
	}, "oncely nats dead-letter publish failed; the message waits", "subject", rec.Topic,
		"sequence", s.md.Sequence.Stream, "dlq_subject", subject)
}
