package rabbitconsumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/backoff"
	"github.com/oncely/oncely/internal/brokersource"
	"github.com/oncely/oncely/internal/ratelog"
	"github.com/oncely/oncely/internal/telemetry"
	"github.com/oncely/oncely/internal/testhook"
)

// Provenance headers of a dead-letter message, beside the oncely-dlq-*
// headers of package dlq (group, message id, attempts, failure times, error
// class, error, trace context; its topic header holds the queue and its
// offset header the delivery tag).
const (
	HeaderQueue         = dlq.Prefix + "queue"          // the queue the message was consumed from
	HeaderExchange      = dlq.Prefix + "exchange"       // the exchange it was published to ("" for the default exchange)
	HeaderRoutingKey    = dlq.Prefix + "routing-key"    // the routing key it was published with
	HeaderDeliveryTag   = dlq.Prefix + "delivery-tag"   // the delivery tag of the last delivery, decimal
	HeaderRedelivered   = dlq.Prefix + "redelivered"    // the last delivery's redelivered flag, "true" or "false"
	HeaderDeliveryCount = dlq.Prefix + "delivery-count" // the earlier deliveries the queue counted (DeliveryCountHeader, AcquiredCountHeader), decimal; 0 on a classic queue
)

// The headers in which a quorum queue counts a message's earlier
// deliveries; a classic queue sets neither. Up to RabbitMQ 4.2,
// x-delivery-count counts every return to the queue, a lost connection's
// included; from 4.3 it counts only the returns taken for failures, and
// x-acquired-count counts every delivery to a consumer. The consumer never
// returns a message itself (it settles each with an ack once decided), so
// each earlier delivery either count shows ended without a verdict: the
// larger is taken.
const (
	DeliveryCountHeader = "x-delivery-count"
	AcquiredCountHeader = "x-acquired-count"
)

// System is the messaging.system of spans and metrics.
const System = "rabbitmq"

// Defaults of Config.
const (
	DefaultConcurrency = 1
	DefaultMaxAttempts = consumer.DefaultMaxAttempts
)

// HeaderAttempts is set on a retry's copy: the attempts the message has
// spent before it, decimal. It is not copied to a dead letter (whose
// oncely-dlq-attempts header says the same).
const HeaderAttempts = "oncely-attempts"

// DefaultRetryQueue is Config.RetryQueue when it is nil: the queue's name
// followed by ".retry".
func DefaultRetryQueue(queue string) string { return queue + ".retry" }

// DefaultDeadLetterRoutingKey is Config.DeadLetterRoutingKey when it is nil:
// the queue's name followed by ".dlq". With the default exchange (the
// default DeadLetterExchange, "") it names the dead-letter queue itself.
func DefaultDeadLetterRoutingKey(queue string) string { return queue + ".dlq" }

// Config configures a Consumer. URL or Dial, Queues, Group, Pool and Handler
// are required.
type Config struct {
	// URL is the AMQP URL to dial ("amqp://guest:guest@localhost:5672/").
	// One of URL and Dial is required.
	URL string
	// Dial, when set, opens the connections instead of URL (TLS, another
	// vhost, credentials from a vault...). The Consumer owns and closes
	// each connection it returns, and calls it again after a connection
	// is lost.
	Dial func(ctx context.Context) (*amqp.Connection, error)
	// Queues are consumed, each with its own consumer on one channel.
	// They must exist (Run declares them passively). Required.
	Queues []string
	// Group is the inbox's consumer group: two Groups process the same
	// message independently, and consumers of one Group (replicas) share
	// its messages' ids. Required.
	Group string

	Pool   *pgxpool.Pool
	Schema string // default "oncely"

	// Handler runs once per new message id, inside the transaction that
	// claimed it. Message.Topic is the queue, Message.Offset the delivery
	// tag, Message.Attempt the attempt counted with the queue's delivery
	// count (Delivery returns the AMQP delivery itself). Required unless
	// BatchHandler is set.
	Handler consumer.Handler

	// BatchSize above 1 turns on batch mode: up to BatchSize deliveries of
	// a queue that the client holds ready share one transaction. Their ids
	// are claimed in the inbox with one multi-row statement; with Handler,
	// each new message runs under a savepoint of its own, so a failing
	// message rolls back alone and, once the others committed, is retried
	// (through the RetryQueue) or dead-lettered on its own. After the
	// COMMIT the batch is acknowledged: with one basic.ack (multiple) of its
	// highest delivery tag when it consumes one queue and every earlier
	// delivery of the channel is settled, else one ack per message. A
	// batch takes the deliveries that are there; it never waits for more.
	// Default 1: a transaction per message.
	BatchSize int
	// BatchHandler, when set with BatchSize above 1, receives all new
	// messages of a batch at once instead of Handler running per message.
	BatchHandler consumer.BatchHandler

	// MessageIDHeader is the header read for the dedup id when the
	// message has no message_id property. Default "message-id". A message
	// with neither has no identity that survives a redelivery: it is
	// dead-lettered at once (class undecodable), never processed without
	// the guarantee.
	MessageIDHeader string

	// MaxAttempts is how many attempts a failing message gets before it
	// is dead-lettered. On a quorum queue, deliveries that ended without a
	// verdict (the process or its connection died) count too, from the
	// queue's x-delivery-count: a delivery that comes after MaxAttempts of
	// them dead-letters the message (class crash_loop) without running
	// it. Default 10.
	MaxAttempts int
	// RetryBaseDelay and RetryMaxDelay bound the backoff between attempts
	// (exponential, full jitter). Defaults 100ms and 30s.
	RetryBaseDelay, RetryMaxDelay time.Duration
	// RetryQueue names the queue in which a queue's failed messages wait
	// for their next attempt: a copy is published to it with the backoff
	// as its expiration, and dead-lettered back to the queue when it
	// expires. Run declares it (a quorum queue without consumers that
	// dead-letters to the queue, at least once, through the default
	// exchange); one that exists with other arguments fails Run. Default
	// DefaultRetryQueue.
	RetryQueue func(queue string) string
	// Concurrency is how many messages (batches, in batch mode) of each
	// queue run at once, each in its own transaction. Default 1.
	Concurrency int
	// Prefetch is the most unacknowledged messages RabbitMQ hands over per
	// queue (basic.qos). Default Concurrency x BatchSize: every message
	// delivered runs at once, and a batch can fill up. More saves a round trip per message where the network is
	// slow, but a message that waits for a place when the process dies is
	// counted as delivered like the ones that ran (a quorum queue counts
	// deliveries, not runs), towards its MaxAttempts. At least Concurrency
	// x BatchSize.
	Prefetch int
	// DeadLetterExchange is the exchange dead letters are published to.
	// Default "": the default exchange, which routes a routing key to the
	// queue of that name.
	DeadLetterExchange string
	// DeadLetterRoutingKey names the routing key of a queue's dead
	// letters. Default DefaultDeadLetterRoutingKey. A dead letter that no
	// queue takes is an error (published mandatory): the message waits.
	DeadLetterRoutingKey func(queue string) string
	// ShutdownTimeout bounds how long Run waits for messages in progress
	// when asked to stop. Default 30s.
	ShutdownTimeout time.Duration
	// ReconnectMaxDelay bounds the backoff between connection attempts.
	// Default 5s.
	ReconnectMaxDelay time.Duration

	Logger         *slog.Logger
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider
	// UntrustedProducers makes each process span a new root, linked to the
	// producer's trace context instead of parented to it.
	UntrustedProducers bool
}

// ErrInvalidConfig is wrapped by New's errors, which name the field.
var ErrInvalidConfig = consumer.ErrInvalidConfig

// ErrNoMessageID is the error of a message that has neither a message_id
// property nor the MessageIDHeader header: it is dead-lettered.
var ErrNoMessageID = errors.New("rabbitconsumer: message has no message_id property and no message id header")

// Consumer consumes RabbitMQ queues so that its handler's effects happen
// once per (Group, message id). Create it with New and run it with Run.
type Consumer struct {
	cfg     Config
	path    *consumer.Consumer
	backoff backoff.Policy
	// outage writes the warnings that repeat while RabbitMQ is
	// unreachable, at most one of a kind a minute.
	outage *ratelog.Limiter

	running  atomic.Bool
	conn     atomic.Pointer[string] // nil while connected; else why not
	dbWaits  atomic.Int64           // deliveries waiting for the database
	classic  sync.Map               // queues seen redelivering without x-delivery-count
	sessions atomic.Int64           // connections established
}

// New validates cfg and returns a Consumer.
func New(cfg Config) (*Consumer, error) {
	cfg.MaxAttempts = cmp.Or(cfg.MaxAttempts, DefaultMaxAttempts)
	cfg.Concurrency = cmp.Or(cfg.Concurrency, DefaultConcurrency)
	cfg.BatchSize = cmp.Or(cfg.BatchSize, 1)
	if cfg.Concurrency > 0 && cfg.BatchSize > 0 {
		cfg.Prefetch = cmp.Or(cfg.Prefetch, cfg.Concurrency*cfg.BatchSize)
	}
	cfg.ShutdownTimeout = cmp.Or(cfg.ShutdownTimeout, 30*time.Second)
	cfg.ReconnectMaxDelay = cmp.Or(cfg.ReconnectMaxDelay, 5*time.Second)
	cfg.RetryBaseDelay = cmp.Or(cfg.RetryBaseDelay, 100*time.Millisecond)
	cfg.RetryMaxDelay = cmp.Or(cfg.RetryMaxDelay, 30*time.Second)
	cfg.MessageIDHeader = cmp.Or(cfg.MessageIDHeader, dlq.HeaderMessageIDDefault)
	if cfg.DeadLetterRoutingKey == nil {
		cfg.DeadLetterRoutingKey = DefaultDeadLetterRoutingKey
	}
	if cfg.RetryQueue == nil {
		cfg.RetryQueue = DefaultRetryQueue
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	invalid := func(field, format string, args ...any) error {
		return fmt.Errorf("%w: %s: %s", ErrInvalidConfig, field, fmt.Sprintf(format, args...))
	}
	switch {
	case cfg.URL == "" && cfg.Dial == nil:
		return nil, invalid("URL", "an AMQP URL (or a Dial func) is required")
	case cfg.URL != "" && cfg.Dial != nil:
		return nil, invalid("Dial", "set URL or Dial, not both")
	case len(cfg.Queues) == 0:
		return nil, invalid("Queues", "at least one queue is required")
	case cfg.Group == "" || len(cfg.Group) > 200:
		return nil, invalid("Group", "a consumer group name of 1 to 200 bytes is required (it names the consumer tags), got %d bytes", len(cfg.Group))
	case cfg.Concurrency < 1:
		return nil, invalid("Concurrency", "must be at least 1, got %d", cfg.Concurrency)
	case cfg.BatchSize < 1:
		return nil, invalid("BatchSize", "must be at least 1, got %d", cfg.BatchSize)
	case cfg.Prefetch < cfg.Concurrency*cfg.BatchSize || cfg.Prefetch > 65535:
		return nil, invalid("Prefetch", "must be from Concurrency x BatchSize (%d) to 65535, got %d",
			cfg.Concurrency*cfg.BatchSize, cfg.Prefetch)
	case cfg.ShutdownTimeout < 0:
		return nil, invalid("ShutdownTimeout", "must not be negative, got %s", cfg.ShutdownTimeout)
	}
	if cfg.URL != "" {
		if _, err := amqp.ParseURI(cfg.URL); err != nil {
			return nil, invalid("URL", "%v", err)
		}
	}
	for i, q := range cfg.Queues {
		switch {
		case q == "" || len(q) > 255:
			return nil, invalid("Queues", "queue %d: a name of 1 to 255 bytes is required, got %q", i, q)
		case slices.Index(cfg.Queues, q) != i:
			return nil, invalid("Queues", "queue %q is listed twice", q)
		}
		if k := cfg.DeadLetterRoutingKey(q); cfg.DeadLetterExchange == "" && (k == q || k == "") {
			return nil, invalid("DeadLetterRoutingKey", "queue %q: the dead letters would go to %q", q, k)
		}
		if k := cfg.RetryQueue(q); k == "" || len(k) > 255 || slices.Contains(cfg.Queues, k) || k == cfg.DeadLetterRoutingKey(q) {
			return nil, invalid("RetryQueue", "queue %q: the retries would wait in %q", q, k)
		}
	}
	idHeader := cfg.MessageIDHeader
	path, err := consumer.NewRecordPath(consumer.Config{
		Group: cfg.Group, Pool: cfg.Pool, Schema: cfg.Schema, Handler: cfg.Handler,
		BatchSize: cfg.BatchSize, BatchHandler: cfg.BatchHandler,
		// The message_id property, then MessageIDHeader; else none.
		KeyFunc: func(rec *kgo.Record) (string, error) {
			if d, ok := deliveryOf(rec); ok && d.MessageId != "" {
				return d.MessageId, nil
			}
			for _, h := range rec.Headers {
				if len(h.Value) > 0 && strings.EqualFold(h.Key, idHeader) {
					return string(h.Value), nil
				}
			}
			return "", fmt.Errorf("%w %q", ErrNoMessageID, idHeader)
		},
		MessageIDHeader: idHeader, MaxAttempts: cfg.MaxAttempts,
		RetryBaseDelay: cfg.RetryBaseDelay, RetryMaxDelay: cfg.RetryMaxDelay,
		DeadLetterTopic: cfg.DeadLetterRoutingKey,
		Logger:          cfg.Logger, TracerProvider: cfg.TracerProvider, MeterProvider: cfg.MeterProvider,
		UntrustedProducers: cfg.UntrustedProducers,
	}, System)
	if err != nil {
		return nil, err
	}
	c := &Consumer{cfg: cfg, path: path, backoff: backoff.Policy{Base: cfg.RetryBaseDelay, Max: cfg.RetryMaxDelay},
		outage: ratelog.New(cfg.Logger, time.Minute)}
	c.disconnected("not connected yet")
	return c, nil
}

// Stats returns the record path's counters (OffsetCommits and
// PartitionsHeld stay 0, Concurrency is the record path's Config.Concurrency,
// which this consumer does not use; CrashLoops counts messages dead-lettered after
// MaxAttempts deliveries that none finished).
func (c *Consumer) Stats() consumer.Stats { return c.path.Stats() }

// Connections is how many connections Run has established: more than one
// after a lost connection was replaced.
func (c *Consumer) Connections() int64 { return c.sessions.Load() }

// Ready reports whether NotReady is empty.
func (c *Consumer) Ready() bool { return c.NotReady() == "" }

// NotReady says why the consumer is not consuming, or "" when it is: Run
// is not running, RabbitMQ is not connected (between a lost connection and
// the next), or a message waits for the database.
func (c *Consumer) NotReady() string {
	switch {
	case !c.running.Load():
		return "not running"
	case c.conn.Load() != nil:
		return "RabbitMQ: " + *c.conn.Load()
	case c.dbWaits.Load() > 0:
		return "the database is unreachable"
	}
	return ""
}

func (c *Consumer) disconnected(why string) { c.conn.Store(&why) }

// deliveryKey carries a record's AMQP delivery in its Context.
type deliveryKey struct{}

// deliveryOf returns the delivery that rec was made from.
func deliveryOf(rec *kgo.Record) (*amqp.Delivery, bool) {
	if rec == nil || rec.Context == nil {
		return nil, false
	}
	d, ok := rec.Context.Value(deliveryKey{}).(*amqp.Delivery)
	return d, ok
}

// Delivery returns the AMQP delivery of a message that a Consumer hands to
// its Handler (its properties: reply-to, correlation id, content type...).
// Do not acknowledge it: the Consumer does, after the commit.
func Delivery(msg *consumer.Message) (*amqp.Delivery, bool) { return deliveryOf(msg.Record) }

// startupError is a check that fails at start-up: a missing queue or
// dead-letter destination.
type startupError struct{ err error }

func (e startupError) Error() string { return e.err.Error() }
func (e startupError) Unwrap() error { return e.err }

// Run connects, checks that the inbox table (consumer.ErrNotMigrated), the
// Queues and the dead-letter destination exist, and consumes until ctx is
// cancelled; then it finishes the messages in progress (bounded by
// ShutdownTimeout) and returns nil. A lost connection or channel is
// replaced, with backoff; its unacknowledged messages come again, and the
// inbox recognises those that had committed. RabbitMQ unreachable at
// start-up is waited for, like a lost connection.
func (c *Consumer) Run(ctx context.Context) error {
	if err := c.path.CheckSchema(ctx); err != nil {
		return err
	}
	if !c.running.CompareAndSwap(false, true) {
		return errors.New("rabbitconsumer: Run is already running")
	}
	defer c.running.Store(false)
	r := &run{c: c, hooks: testhook.ConsumerFrom(ctx), slots: map[string]chan struct{}{}}
	for _, q := range c.cfg.Queues {
		r.slots[q] = make(chan struct{}, c.cfg.Concurrency)
	}
	// In-progress messages survive ctx, for the drain; workCtx ends them.
	workCtx, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	r.workCtx = workCtx
	runCtx, cancelRun := context.WithCancelCause(ctx)
	defer cancelRun(nil)
	r.ctx, r.fail = runCtx, cancelRun
	c.cfg.Logger.Info("oncely rabbitmq consumer started", "queues", c.cfg.Queues, "group", c.cfg.Group)

	reconnect := backoff.Policy{Base: 100 * time.Millisecond, Max: c.cfg.ReconnectMaxDelay}
	for n := 1; runCtx.Err() == nil; n++ {
		err := r.session(runCtx)
		if r.connected {
			n, r.connected = 1, false
		}
		if se := (startupError{}); errors.As(err, &se) && !r.checked {
			cancelRun(err) // a configuration error: no wait will mend it
		}
		if err == nil || runCtx.Err() != nil {
			break
		}
		c.disconnected(err.Error())
		delay := reconnect.Delay(n)
		c.outage.Warn(runCtx, "oncely rabbitmq connection failed; reconnecting", "queues", c.cfg.Queues, "delay", delay, "err", err)
		r.pause(runCtx, delay)
	}
	c.disconnected("stopped")
	brokersource.Drain(&r.wg, c.cfg.ShutdownTimeout, cancelWork)
	r.closeConn() // what is still unacknowledged goes back to its queue
	// The outbox wake-ups that the last commits owe.
	c.path.WaitWakeUps(context.WithoutCancel(ctx))
	if err := brokersource.StopError(ctx, runCtx); err != nil {
		c.cfg.Logger.Error("oncely rabbitmq consumer stopped", "err", err)
		return err
	}
	c.cfg.Logger.Info("oncely rabbitmq consumer stopped", "queues", c.cfg.Queues, "group", c.cfg.Group)
	return nil
}

// run is the state of one Run call.
type run struct {
	c       *Consumer
	hooks   *testhook.Consumer
	ctx     context.Context // ends when Run is asked to stop, or fails
	workCtx context.Context // ends when the drain gives up
	// fail stops Run, which returns its error: a simulated crash, or a
	// start-up check that failed.
	fail  context.CancelCauseFunc
	slots map[string]chan struct{} // per queue, Concurrency places: one per running attempt
	wg    sync.WaitGroup

	// checked: a session's start-up checks passed once; a check failing
	// later (a queue deleted while running) is waited out like an outage.
	checked bool
	// connected: the last session consumed (the reconnection backoff
	// starts again).
	connected bool

	mu   sync.Mutex
	conn *amqp.Connection // the current connection; closed at the end
}

// pause waits d; false once ctx ends.
func (r *run) pause(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

func (r *run) closeConn() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.conn != nil {
		_ = r.conn.Close()
		r.conn = nil
	}
}

// dial opens a connection with fn, or else to url, named name in
// RabbitMQ's connection list, with 10s heartbeats.
func dial(ctx context.Context, url string, fn func(context.Context) (*amqp.Connection, error), name string) (*amqp.Connection, error) {
	var conn *amqp.Connection
	var err error
	if fn != nil {
		conn, err = fn(ctx)
	} else {
		props := amqp.NewConnectionProperties()
		props.SetClientConnectionName(name)
		conn, err = amqp.DialConfig(url, amqp.Config{Heartbeat: 10 * time.Second, Properties: props, Dial: amqp.DefaultDial(10 * time.Second)})
	}
	if err != nil {
		return nil, fmt.Errorf("rabbitconsumer: connect: %w", err)
	}
	return conn, nil
}

// session runs one connection: it checks the queues and the dead-letter
// destination, consumes every queue and returns when the connection or a
// channel closed (its error) or ctx ended (nil: the consumers are
// cancelled, and the connection stays open for the messages in progress
// to settle; Run closes it). A check that fails is a startupError.
func (r *run) session(ctx context.Context) error {
	c := r.c
	conn, err := dial(ctx, c.cfg.URL, c.cfg.Dial, "oncely consumer "+c.cfg.Group)
	if err != nil {
		return err
	}
	r.closeConn()
	r.mu.Lock()
	r.conn = conn
	r.mu.Unlock()
	stopping := false
	// lost ends the waits of this connection's deliveries: it can no
	// longer settle them, or Run stops.
	lost := make(chan struct{})
	var consumers sync.WaitGroup
	defer func() {
		close(lost)
		if !stopping {
			_ = conn.Close() // ends the consumers' delivery channels
		}
		consumers.Wait()
	}()
	connClosed := conn.NotifyClose(make(chan *amqp.Error, 1))
	if err := r.check(conn); err != nil {
		return err
	}
	r.checked = true
	pub, err := newConfirmer(conn)
	if err != nil {
		return err
	}
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("rabbitconsumer: open consuming channel: %w", err)
	}
	chClosed := ch.NotifyClose(make(chan *amqp.Error, 1))
	pubClosed := pub.ch.NotifyClose(make(chan *amqp.Error, 1))
	if err := ch.Qos(c.cfg.Prefetch, 0, false); err != nil {
		return fmt.Errorf("rabbitconsumer: basic.qos prefetch %d: %w", c.cfg.Prefetch, err)
	}
	// One queue's deliveries arrive, in delivery-tag order, on one Go
	// channel: its batches can be acknowledged with one multiple ack.
	s := &session{r: r, ch: ch, pub: pub, lost: lost,
		acks: &acker{ch: ch, tracked: c.cfg.BatchSize > 1 && len(c.cfg.Queues) == 1}}
	// cancelled gets the queue of a consumer that RabbitMQ cancelled (its
	// queue was deleted, or a quorum queue's leader moved): the session
	// ends, and the next one consumes it again, or waits for it.
	cancelled := make(chan string, len(c.cfg.Queues))
	tags := make([]string, len(c.cfg.Queues))
	for i, q := range c.cfg.Queues {
		tags[i] = "oncely-" + c.cfg.Group + "-" + strconv.Itoa(i)
		deliveries, err := ch.Consume(q, tags[i], false, false, false, false, nil)
		if err != nil {
			return fmt.Errorf("rabbitconsumer: consume queue %q: %w", q, err)
		}
		if c.cfg.BatchSize == 1 {
			s.consumeEach(q, deliveries, cancelled)
			continue
		}
		consumers.Add(1)
		go func() {
			defer consumers.Done()
			s.consumeBatches(q, deliveries)
			cancelled <- q
		}()
	}
	c.sessions.Add(1)
	r.connected = true
	c.conn.Store(nil)
	c.cfg.Logger.Info("oncely rabbitmq connected", "queues", c.cfg.Queues, "prefetch", c.cfg.Prefetch,
		"batch_size", c.cfg.BatchSize)
	var closed *amqp.Error
	select {
	case <-ctx.Done():
		// No new deliveries; those in progress settle on this channel.
		stopping = true
		for _, tag := range tags {
			_ = ch.Cancel(tag, false)
		}
		return nil
	case closed = <-connClosed:
	case closed = <-chClosed:
	case closed = <-pubClosed:
	case q := <-cancelled:
		c.disconnected(fmt.Sprintf("the consumer of queue %q was cancelled", q))
		return fmt.Errorf("rabbitconsumer: RabbitMQ cancelled the consumer of queue %q (deleted, or its leader moved)", q)
	}
	if closed == nil {
		closed = amqp.ErrClosed
	}
	c.disconnected("connection lost: " + closed.Error())
	return fmt.Errorf("rabbitconsumer: connection or channel closed: %w", closed)
}

// check declares each queue and the dead-letter destination passively, and
// each retry queue, each on a channel of its own (a failed declaration
// closes its channel).
func (r *run) check(conn *amqp.Connection) error {
	c := r.c
	declare := func(what string, declare func(*amqp.Channel) error) error {
		ch, err := conn.Channel()
		if err != nil {
			return fmt.Errorf("rabbitconsumer: open channel: %w", err)
		}
		defer func() { _ = ch.Close() }()
		if err := declare(ch); err != nil {
			var ae *amqp.Error
			switch {
			case errors.As(err, &ae) && ae.Code == amqp.NotFound:
				return startupError{fmt.Errorf("rabbitconsumer: %s does not exist: %w", what, err)}
			case errors.As(err, &ae) && ae.Code == amqp.PreconditionFailed:
				return startupError{fmt.Errorf("rabbitconsumer: %s exists with other arguments: %w", what, err)}
			}
			return fmt.Errorf("rabbitconsumer: %s: %w", what, err)
		}
		return nil
	}
	for _, q := range c.cfg.Queues {
		if err := declare(fmt.Sprintf("queue %q (Queues)", q), func(ch *amqp.Channel) error {
			_, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
			return err
		}); err != nil {
			return err
		}
		rq := c.cfg.RetryQueue(q)
		if err := declare(fmt.Sprintf("retry queue %q (RetryQueue of queue %q)", rq, q), func(ch *amqp.Channel) error {
			_, err := ch.QueueDeclare(rq, true, false, false, false, retryQueueArgs(q))
			return err
		}); err != nil {
			return err
		}
		if c.cfg.DeadLetterExchange != "" {
			continue
		}
		dq := c.cfg.DeadLetterRoutingKey(q)
		if err := declare(fmt.Sprintf("dead-letter queue %q (DeadLetterRoutingKey of queue %q)", dq, q), func(ch *amqp.Channel) error {
			_, err := ch.QueueDeclarePassive(dq, true, false, false, false, nil)
			return err
		}); err != nil {
			return err
		}
	}
	if x := c.cfg.DeadLetterExchange; x != "" {
		return declare(fmt.Sprintf("dead-letter exchange %q (DeadLetterExchange)", x), func(ch *amqp.Channel) error {
			return ch.ExchangeDeclarePassive(x, "direct", true, false, false, false, nil)
		})
	}
	return nil
}

// retryQueueArgs are the arguments of queue's retry queue: a quorum queue
// (replicated, like the queues it serves) that dead-letters an expired copy
// back to queue through the default exchange at least once (RabbitMQ
// confirms it into queue before it drops it here, which needs the
// reject-publish overflow).
func retryQueueArgs(queue string) amqp.Table {
	return amqp.Table{
		"x-queue-type": "quorum", "x-dead-letter-exchange": "", "x-dead-letter-routing-key": queue,
		"x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish",
	}
}

// session is one connection's channels.
type session struct {
	r    *run
	ch   *amqp.Channel // consuming: its deliveries are acknowledged on it
	pub  *confirmer    // dead letters
	lost chan struct{} // closed when the connection is replaced or Run stops
	acks *acker        // acknowledges ch's deliveries
}

// handle runs one delivery through the record path in a place of
// Concurrency.
func (s *session) handle(queue string, d amqp.Delivery) {
	r := s.r
	slots := r.slots[queue]
	select {
	case slots <- struct{}{}:
	case <-s.lost:
		return // unacknowledged: it comes again on the next connection
	case <-r.ctx.Done():
		return
	}
	defer func() { <-slots }()
	src := s.source(queue, &d)
	defer src.DatabaseDown(false)
	ctx := consumer.WithSpanAttributes(r.workCtx, telemetry.MessagingRabbitMQRoutingKey.String(d.RoutingKey),
		telemetry.MessagingRabbitMQDeliveryTag.Int64(int64(d.DeliveryTag)))
	r.c.path.Deliver(ctx, src.rec, src)
}

// consumeEach runs queue's deliveries one at a time in each of Concurrency
// workers, which take them from the client as they finish the one before,
// until the deliveries end; then the last worker reports queue on
// cancelled. The workers are among the messages in progress (run.wg): a
// graceful stop waits for them, bounded by ShutdownTimeout.
func (s *session) consumeEach(queue string, deliveries <-chan amqp.Delivery, cancelled chan<- string) {
	r := s.r
	var left atomic.Int32
	left.Store(int32(r.c.cfg.Concurrency))
	for range r.c.cfg.Concurrency {
		r.wg.Go(func() {
			for d := range deliveries {
				s.handle(queue, d)
			}
			if left.Add(-1) == 0 {
				cancelled <- queue
			}
		})
	}
}

// source is d, delivered from queue on this session's channel, as a
// consumer.Source.
func (s *session) source(queue string, d *amqp.Delivery) *source {
	src := &source{s: s, d: d, rec: record(queue, d), queue: queue}
	src.spent = src.retried() + src.deliveryCount()
	return src
}

// record is d as the record path sees it: Topic the queue, Offset the
// delivery tag, the headers in key order (values that are not strings or
// bytes in their text form), Timestamp the timestamp property, or the time
// of delivery without one. Its Context carries d (Delivery).
func record(queue string, d *amqp.Delivery) *kgo.Record {
	rec := &kgo.Record{Topic: queue, Offset: int64(d.DeliveryTag), Value: d.Body, Timestamp: d.Timestamp,
		Context: context.WithValue(context.Background(), deliveryKey{}, d)}
	if rec.Timestamp.IsZero() {
		rec.Timestamp = time.Now()
	}
	for _, k := range slices.Sorted(maps.Keys(d.Headers)) {
		rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: k, Value: headerBytes(d.Headers[k])})
	}
	return rec
}

// headerBytes is an AMQP table value as a record header's value.
func headerBytes(v any) []byte {
	switch v := v.(type) {
	case string:
		return []byte(v)
	case []byte:
		return v
	case nil:
		return nil
	}
	return fmt.Append(nil, v)
}

// source is one AMQP delivery as a consumer.Source.
type source struct {
	s     *session
	d     *amqp.Delivery
	rec   *kgo.Record // d as the record path sees it
	queue string
	spent int
	// dbDown: the database did not answer the last attempt (counted in
	// Consumer.dbWaits).
	dbDown bool
	// batch, in batch mode, collects the acknowledgements of the batch's
	// settled messages, sent together (batchAcks).
	batch *batchAcks
}

// retried is the HeaderAttempts of a retry's copy: the attempts spent
// before it was published.
func (s *source) retried() int {
	n, err := strconv.Atoi(string(headerBytes(s.d.Headers[HeaderAttempts])))
	if err != nil || n < 0 {
		return 0
	}
	return n
}

// deliveryCount is the quorum queue's count of d's earlier deliveries
// (the larger of DeliveryCountHeader and AcquiredCountHeader). A redelivery
// without one (a classic queue) is warned about, once per queue: deliveries
// that end with the process are not counted there.
func (s *source) deliveryCount() int {
	n, counted := 0, false
	for _, h := range []string{DeliveryCountHeader, AcquiredCountHeader} {
		var v int64
		switch x := s.d.Headers[h].(type) {
		case int64:
			v = x
		case int32:
			v = int64(x)
		case int16:
			v = int64(x)
		case int:
			v = int64(x)
		default:
			continue
		}
		n, counted = max(n, int(v)), true
	}
	if !counted && s.d.Redelivered {
		if _, seen := s.s.r.c.classic.LoadOrStore(s.queue, true); !seen {
			s.s.r.c.cfg.Logger.Warn("oncely rabbitmq queue redelivers without x-delivery-count (a classic queue?): "+
				"a message that kills the process is not detected there; use a quorum queue", "queue", s.queue)
		}
	}
	return n
}

// Spent: the attempts of the retries before this copy (HeaderAttempts),
// and the deliveries of this copy before this one, which reached no
// verdict, each an attempt (a quorum queue's count; none on a classic
// queue).
func (s *source) Spent() int { return s.spent }

// wait waits d; false once the connection is lost or the drain gives up.
func (s *source) wait(d time.Duration, stop <-chan struct{}) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-s.s.lost:
	case <-s.s.r.workCtx.Done():
	case <-stop:
	}
	return false
}

// Pause waits d in its place (contention, or the database unreachable).
func (s *source) Pause(d time.Duration) bool {
	s.batch.flush()
	return s.wait(d, nil)
}

// Retry hands the message back for its next attempt after delay: a copy
// (HeaderAttempts the attempts spent) is published to the queue's
// RetryQueue with delay as its expiration, RabbitMQ dead-letters it back to
// the queue when it expires, and the original is acknowledged once the
// copy is confirmed. Meanwhile the message holds no place: the queue flows.
// When the copy cannot be published, the message waits here instead, in
// its place, and runs again (true).
func (s *source) Retry(ctx context.Context, delay time.Duration) bool {
	s.batch.flush()
	c, r := s.s.r.c, s.s.r
	rq := c.cfg.RetryQueue(s.queue)
	pctx, cancel := context.WithTimeout(ctx, brokersource.PublishTimeout)
	err := s.s.pub.publish(pctx, "", rq, s.retryCopy(delay))
	cancel()
	if err != nil {
		c.outage.Warn(ctx, "oncely rabbitmq retry publish failed; the message waits in the process", "queue", s.queue,
			"retry_queue", rq, "err", err)
		return s.wait(delay, s.s.r.ctx.Done())
	}
	if h := r.hooks.AfterRetryCopy; h != nil {
		if err := h(s.rec); errors.Is(err, testhook.ErrCrash) {
			r.fail(fmt.Errorf("rabbitconsumer: %w", err))
			return false
		}
	}
	if err := s.s.acks.ack(s.d.DeliveryTag); err != nil {
		// The copy is stored: the original comes again as well, and the
		// inbox lets one of the two apply.
		c.cfg.Logger.Warn("oncely rabbitmq ack after the retry's copy failed; the message comes again too",
			"queue", s.queue, "delivery_tag", s.d.DeliveryTag, "err", err)
	}
	return false
}

// retryCopy is the message again, with HeaderAttempts the attempts spent
// (this one included) and the expiration delay (which RabbitMQ removes when
// it dead-letters the copy back).
func (s *source) retryCopy(delay time.Duration) amqp.Publishing {
	headers := amqp.Table{}
	maps.Copy(headers, s.d.Headers)
	delete(headers, DeliveryCountHeader) // this copy's deliveries are counted afresh
	delete(headers, AcquiredCountHeader)
	headers[HeaderAttempts] = strconv.Itoa(s.spent + 1)
	msg := publishing(s.d, headers)
	msg.Expiration = strconv.FormatInt(max(delay.Milliseconds(), 0), 10)
	return msg
}

// publishing is d as a persistent message with headers: its body and
// properties, not its expiration, nor its user id (which RabbitMQ checks
// against the publishing connection's user).
func publishing(d *amqp.Delivery, headers amqp.Table) amqp.Publishing {
	return amqp.Publishing{
		Headers: headers, ContentType: d.ContentType, ContentEncoding: d.ContentEncoding,
		DeliveryMode: amqp.Persistent, Priority: d.Priority, CorrelationId: d.CorrelationId, ReplyTo: d.ReplyTo,
		MessageId: d.MessageId, Timestamp: d.Timestamp, Type: d.Type, AppId: d.AppId, Body: d.Body,
	}
}

// DatabaseDown counts the delivery among those waiting for the database
// (NotReady) while the database does not answer it.
func (s *source) DatabaseDown(down bool) {
	if down != s.dbDown {
		s.dbDown = down
		if down {
			s.s.r.c.dbWaits.Add(1)
		} else {
			s.s.r.c.dbWaits.Add(-1)
		}
	}
}

// Settle acknowledges the delivery, after the crash-point hooks. An ack on
// a lost connection fails: RabbitMQ delivers the message again, and the
// inbox skips it.
func (s *source) Settle(_ context.Context, rec *kgo.Record, deadLettered bool) bool {
	r := s.s.r
	h := r.hooks.AfterCommit
	if deadLettered {
		h = r.hooks.AfterDeadLetter
	}
	if h != nil {
		if err := h(rec); errors.Is(err, testhook.ErrCrash) {
			r.fail(fmt.Errorf("rabbitconsumer: %w", err))
			return false
		}
	}
	if s.batch != nil {
		s.batch.settled(s)
		return true
	}
	if err := s.s.acks.ack(s.d.DeliveryTag); err != nil {
		r.c.cfg.Logger.Warn("oncely rabbitmq ack failed; the message comes again and is skipped as a duplicate",
			"queue", s.queue, "delivery_tag", s.d.DeliveryTag, "err", err)
		return false
	}
	return true
}

// PublishDeadLetter publishes the dead-letter copy (the message's body,
// properties and headers, package dlq's headers and the provenance headers)
// to DeadLetterExchange with the queue's DeadLetterRoutingKey, mandatory
// and persistent, and waits for the publisher confirmation, retrying with
// backoff meanwhile. It gives up only when the connection is lost (the
// message comes again) or the drain ends.
func (s *source) PublishDeadLetter(ctx context.Context, rec *kgo.Record, info *dlq.Info) bool {
	s.batch.flush()
	c := s.s.r.c
	exchange, key := c.cfg.DeadLetterExchange, c.cfg.DeadLetterRoutingKey(s.queue)
	return brokersource.Retrier{Backoff: c.backoff, Outage: c.outage}.Publish(ctx, s.Pause, func(pctx context.Context) error {
		return s.s.pub.publish(pctx, exchange, key, s.deadLetter(c.path.DeadLetterRecord(ctx, rec, info)))
	}, "oncely rabbitmq dead-letter publish failed; the message waits", "queue", s.queue,
		"exchange", exchange, "routing_key", key)
}

// deadLetter is the AMQP message of a dead-letter record: the delivery
// again, with out's headers (their original AMQP types where unchanged) and
// the provenance headers.
func (s *source) deadLetter(out *kgo.Record) amqp.Publishing {
	d := s.d
	headers := table(out, d.Headers)
	delete(headers, DeliveryCountHeader) // the dead-letter queue counts its own deliveries
	delete(headers, AcquiredCountHeader)
	delete(headers, HeaderAttempts) // oncely-dlq-attempts says it
	headers[HeaderQueue] = s.queue
	headers[HeaderExchange] = d.Exchange
	headers[HeaderRoutingKey] = d.RoutingKey
	headers[HeaderDeliveryTag] = strconv.FormatUint(d.DeliveryTag, 10)
	headers[HeaderRedelivered] = strconv.FormatBool(d.Redelivered)
	headers[HeaderDeliveryCount] = strconv.Itoa(s.deliveryCount())
	return publishing(d, headers)
}

// table is rec's headers as an AMQP table: a header whose value is
// unchanged from the delivery's headers orig keeps its AMQP type (an
// int32 stays an int32), the others are strings.
func table(rec *kgo.Record, orig amqp.Table) amqp.Table {
	headers := amqp.Table{}
	for _, h := range rec.Headers {
		if v, ok := orig[h.Key]; ok && string(headerBytes(v)) == string(h.Value) {
			headers[h.Key] = v
			continue
		}
		headers[h.Key] = string(h.Value)
	}
	return headers
}
