package oncely

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/idempotency"
	"github.com/oncely/oncely/internal/sqlident"
	"github.com/oncely/oncely/outbox"
	"github.com/oncely/oncely/webhook"
	"github.com/oncely/oncely/webhook/outbound"
)

// Config configures a Runner. Zero values take the documented defaults.
type Config struct {
	// Pool runs every component's transactions. Required.
	Pool *pgxpool.Pool
	// Schema holds oncely's tables; it goes into every component's
	// configuration. Default "oncely".
	Schema string
	// Brokers are the seed brokers of the consumers and the relay whose
	// configurations name none. Required when there is a consumer or a relay.
	Brokers []string
	// KafkaOpts are franz-go options for every Kafka client the runner and
	// its components create (TLS, SASL, a client id...), applied before a
	// component's own ClientOpts.
	KafkaOpts []kgo.Opt

	// Logger receives the runner's and the components' logs. Default: discard.
	Logger *slog.Logger
	// TracerProvider instruments every component. Default: the global one.
	TracerProvider trace.TracerProvider
	// MeterProvider instruments every component. Default: an SDK provider the
	// runner builds, whose metrics GET /metrics serves in the Prometheus text
	// format, and which Run shuts down on return.
	MeterProvider metric.MeterProvider
	// MetricsHandler serves GET /metrics. Default: the runner's Prometheus
	// exporter when MeterProvider is unset; otherwise /metrics answers 404.
	// With a provider of your own, add PrometheusExporter's reader to it and
	// pass its handler here.
	MetricsHandler http.Handler

	// HTTPAddr, when set, makes the runner serve Handler (its endpoints and
	// the application's routes, see Handle) on this address, as AddServer
	// does: from the start of Run, and stopped first on the way out. An
	// address Run cannot listen on is its error, before anything starts.
	// Listener, when set, is served instead of listening on HTTPAddr (a
	// test's 127.0.0.1:0, an inherited socket). For other server settings
	// than a 5s ReadHeaderTimeout, use AddServer.
	HTTPAddr string
	Listener net.Listener

	// Migrate applies oncely's pending migrations to Schema at the start of
	// Run, under the migrations' advisory lock (any number of instances may
	// start at once). Without it, Run fails when a migration is missing.
	Migrate bool
	// BeforeStart, when set, runs after the migrations and before the start
	// checks and the components: the application's own tables, say. Its
	// error is Run's. /readyz answers "starting" until it returned.
	BeforeStart func(ctx context.Context) error

	// Relay, when set, runs an outbox relay; its Outbox.Schema, Pool,
	// Brokers, Logger and providers default to the runner's. It counts for
	// two connections of the pool (its LISTEN session and its transactions).
	Relay *outbox.RelayConfig
	// InboxCleaner, when set, runs a dedup.Cleaner; its Schema and Logger
	// default to the runner's.
	InboxCleaner *dedup.CleanerConfig
	// ExtraConns are the pool connections the application uses next to the
	// runner's components, such as its HTTP handlers'. The pool check counts
	// them. Default 0.
	ExtraConns int

	// ShutdownTimeout bounds the shutdown (see the package documentation).
	// A consumer's drain gets what is left after RelayFlushTimeout and one
	// second for the rest; a consumer.Config.ShutdownTimeout above that is
	// an error. Default 8s.
	ShutdownTimeout time.Duration
	// RelayFlushTimeout is how long the relay may publish the outbox's
	// pending rows after the consumers drained and the HTTP servers stopped.
	// Default 1s.
	RelayFlushTimeout time.Duration
	// HealthInterval is how often the runner pings the database for
	// /readyz; topics are checked again every ten intervals. Default 1s.
	HealthInterval time.Duration
}

// ErrInvalidConfig is wrapped by every configuration error of New and the
// Add methods.
var ErrInvalidConfig = errors.New("oncely: invalid config")

func invalid(field, format string, args ...any) error {
	return fmt.Errorf("%w: %s: %s", ErrInvalidConfig, field, fmt.Sprintf(format, args...))
}

// Connections the pool check counts for components other than consumers.
const (
	relayConns   = 2 // LISTEN session + a shard transaction
	cleanupConns = 1 // the cleanups and the health ping, one short statement at a time
)

// Runner runs a service's oncely components. Create it with New, add
// components, and call Run once.
type Runner struct {
	cfg     Config
	reserve int // pool connections kept for the relay, the cleanups and ExtraConns

	outbox        *outbox.Outbox
	outboundStore *outbound.Store
	relay         *outbox.Relay
	cleaner       *dedup.Cleaner
	consumers     []*consumerEntry
	workers       []workerEntry
	loops         []loop // cleanups and services: stopped first, no order among them
	servers       []*server

	ownMeter *sdkmetric.MeterProvider // built by New; shut down by Run
	metrics  http.Handler
	mux      *http.ServeMux // Handler: the runner's endpoints and Handle's routes

	mu      sync.Mutex // guards the Add methods against Run
	ran     bool
	phase   atomic.Pointer[string]
	started atomic.Bool
	health  health
}

type consumerEntry struct {
	c      *consumer.Consumer
	group  string
	topics []string
	dlq    func(string) string
	// brokers and opts reach the consumer's cluster, for the topic check.
	brokers []string
	opts    []kgo.Opt
}

type loop struct {
	name string
	run  func(ctx context.Context) error
}

type workerEntry struct {
	name string
	w    Worker
}

// Phases of Run, as /readyz reports them.
var (
	phaseNew       = "not running yet"
	phaseMigrating = "starting: applying migrations"
	phaseSetup     = "starting: BeforeStart"
	phaseChecking  = "starting: checking the schema and topics"
	phaseRunning   = "running"
	phaseStopping  = "stopping"
	phaseStopped   = "stopped"
)

// New validates cfg and returns a Runner. Errors name the offending field
// and wrap ErrInvalidConfig.
func New(cfg Config) (*Runner, error) {
	cfg.Schema = cmp.Or(cfg.Schema, sqlident.DefaultSchema)
	cfg.Logger = cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	cfg.ShutdownTimeout = cmp.Or(cfg.ShutdownTimeout, 8*time.Second)
	cfg.RelayFlushTimeout = cmp.Or(cfg.RelayFlushTimeout, time.Second)
	cfg.HealthInterval = cmp.Or(cfg.HealthInterval, time.Second)
	switch {
	case cfg.Pool == nil:
		return nil, invalid("Config.Pool", "a *pgxpool.Pool is required")
	case cfg.ExtraConns < 0:
		return nil, invalid("Config.ExtraConns", "must not be negative, got %d", cfg.ExtraConns)
	case cfg.ShutdownTimeout < 0 || cfg.RelayFlushTimeout < 0 || cfg.HealthInterval < 0:
		return nil, invalid("Config.ShutdownTimeout, RelayFlushTimeout and HealthInterval", "must not be negative")
	case cfg.ShutdownTimeout < cfg.RelayFlushTimeout+2*time.Second:
		return nil, invalid("Config.ShutdownTimeout", "%s leaves no time to drain the consumers: want at least RelayFlushTimeout (%s) + 2s",
			cfg.ShutdownTimeout, cfg.RelayFlushTimeout)
	}
	if err := sqlident.ValidateSchema("Config.Schema", cfg.Schema); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	for i, b := range cfg.Brokers {
		if b == "" {
			return nil, invalid("Config.Brokers", "broker %d is empty", i)
		}
	}
	r := &Runner{cfg: cfg, reserve: cleanupConns + cfg.ExtraConns, metrics: cfg.MetricsHandler}
	r.phase.Store(&phaseNew)
	var err error
	if r.outbox, err = outbox.New(outbox.Config{Schema: cfg.Schema}); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	if r.outboundStore, err = outbound.NewStore(outbound.Config{Schema: cfg.Schema}); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	if cfg.MeterProvider == nil {
		reader, handler, err := PrometheusExporter()
		if err != nil {
			return nil, err
		}
		r.ownMeter = sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
		r.cfg.MeterProvider = r.ownMeter
		if r.metrics == nil {
			r.metrics = handler
		}
	}
	if cfg.Relay != nil {
		if err := r.newRelay(*cfg.Relay); err != nil {
			return nil, err
		}
		r.reserve += relayConns
	}
	if cfg.InboxCleaner != nil {
		cc := *cfg.InboxCleaner
		if err := r.sameSchema("dedup.CleanerConfig.Schema", &cc.Schema); err != nil {
			return nil, err
		}
		cc.Logger = cmp.Or(cc.Logger, cfg.Logger)
		if r.cleaner, err = dedup.NewCleaner(cfg.Pool, cc); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
		}
		r.loops = append(r.loops, loop{"inbox cleaner", r.cleaner.Run})
	}
	if int(cfg.Pool.Config().MaxConns) <= r.reserve {
		return nil, r.poolTooSmall(r.reserve+1-int(cfg.Pool.Config().MaxConns), "a consumer")
	}
	r.mux = r.newMux()
	if cfg.HTTPAddr != "" || cfg.Listener != nil {
		srv := &http.Server{Addr: cfg.HTTPAddr, Handler: r.mux, ReadHeaderTimeout: 5 * time.Second}
		r.servers = append(r.servers, newServer(srv, cfg.Listener, "Config.HTTPAddr"))
	}
	return r, nil
}

// sameSchema sets *schema to the runner's schema when empty, and fails when
// it names another one.
func (r *Runner) sameSchema(field string, schema *string) error {
	if *schema != "" && *schema != r.cfg.Schema {
		return invalid(field, "%q differs from Config.Schema %q; set the schema once, in Config.Schema", *schema, r.cfg.Schema)
	}
	*schema = r.cfg.Schema
	return nil
}

// samePool sets *pool to the runner's pool when nil, and fails when it is
// another one: the pool check would not hold.
func (r *Runner) samePool(field string, pool **pgxpool.Pool) error {
	if *pool != nil && *pool != r.cfg.Pool {
		return invalid(field, "is not Config.Pool; the runner's components share one pool, set once")
	}
	*pool = r.cfg.Pool
	return nil
}

// brokers fills an empty broker list with the runner's.
func (r *Runner) brokers(field string, bs *[]string) error {
	if len(*bs) == 0 {
		*bs = r.cfg.Brokers
	}
	if len(*bs) == 0 {
		return invalid("Config.Brokers", "required by %s (or set %s)", field, field)
	}
	return nil
}

func (r *Runner) kafkaOpts(own []kgo.Opt) []kgo.Opt {
	return append(append([]kgo.Opt(nil), r.cfg.KafkaOpts...), own...)
}

func (r *Runner) newRelay(rc outbox.RelayConfig) error {
	if err := r.sameSchema("outbox.RelayConfig.Outbox.Schema", &rc.Outbox.Schema); err != nil {
		return err
	}
	if err := r.samePool("outbox.RelayConfig.Pool", &rc.Pool); err != nil {
		return err
	}
	if rc.Publisher == nil { // else it publishes to another broker: no Kafka
		if err := r.brokers("outbox.RelayConfig.Brokers", &rc.Brokers); err != nil {
			return err
		}
		rc.ClientOpts = r.kafkaOpts(rc.ClientOpts)
	}
	rc.Logger = cmp.Or(rc.Logger, r.cfg.Logger)
	rc.TracerProvider = cmp.Or(rc.TracerProvider, r.cfg.TracerProvider)
	rc.MeterProvider = cmp.Or(rc.MeterProvider, r.cfg.MeterProvider)
	var err error
	if r.relay, err = outbox.NewRelay(rc); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	return nil
}

func (r *Runner) poolTooSmall(more int, what string) error {
	relay := 0
	if r.relay != nil {
		relay = relayConns
	}
	return invalid("Config.Pool", "MaxConns %d is %d too small: the relay (%d), the cleanups (%d) and ExtraConns (%d) keep %d connections, and %s needs the rest; raise MaxConns (pool_max_conns in the URL)",
		r.cfg.Pool.Config().MaxConns, more, relay, cleanupConns, r.cfg.ExtraConns, r.reserve, what)
}

// addable fails once Run has been called.
func (r *Runner) addable(what string) error {
	if r.ran {
		return fmt.Errorf("oncely: %s after Run", what)
	}
	return nil
}

// AddConsumer creates a consumer that Run runs. Its Schema, Pool, Brokers,
// Logger and providers default to the runner's (another schema or pool is
// an error); Config.KafkaOpts come before its ClientOpts.
//
// Its Concurrency defaults to the pool's MaxConns less the connections kept
// for the relay, the cleanups and ExtraConns; consumers added to one runner
// share those connections. A Concurrency above that, or below the
// consumer's KeyParallelism (whose lanes would wait for each other's
// connections), is an error naming Config.Pool. Its ShutdownTimeout
// defaults to the part of Config.ShutdownTimeout left for draining.
func (r *Runner) AddConsumer(cfg consumer.Config) (*consumer.Consumer, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.addable("AddConsumer"); err != nil {
		return nil, err
	}
	if err := r.sameSchema("consumer.Config.Schema", &cfg.Schema); err != nil {
		return nil, err
	}
	if err := r.samePool("consumer.Config.Pool", &cfg.Pool); err != nil {
		return nil, err
	}
	if err := r.brokers("consumer.Config.Brokers", &cfg.Brokers); err != nil {
		return nil, err
	}
	cfg.ClientOpts = r.kafkaOpts(cfg.ClientOpts)
	cfg.Logger = cmp.Or(cfg.Logger, r.cfg.Logger)
	cfg.TracerProvider = cmp.Or(cfg.TracerProvider, r.cfg.TracerProvider)
	cfg.MeterProvider = cmp.Or(cfg.MeterProvider, r.cfg.MeterProvider)

	drain := r.cfg.ShutdownTimeout - r.cfg.RelayFlushTimeout - time.Second
	if cfg.ShutdownTimeout > drain {
		return nil, invalid("consumer.Config.ShutdownTimeout", "%s does not fit in Config.ShutdownTimeout %s less RelayFlushTimeout %s and 1s",
			cfg.ShutdownTimeout, r.cfg.ShutdownTimeout, r.cfg.RelayFlushTimeout)
	}
	cfg.ShutdownTimeout = cmp.Or(cfg.ShutdownTimeout, drain)

	avail := int(r.cfg.Pool.Config().MaxConns) - r.reserve
	lanes := max(cfg.KeyParallelism, 1)
	if cfg.Concurrency > 0 && cfg.Concurrency < lanes {
		return nil, invalid("consumer.Config.Concurrency", "%d is below KeyParallelism %d: the lanes of one partition would wait for each other", cfg.Concurrency, lanes)
	}
	if need := cmp.Or(cfg.Concurrency, lanes); need > avail {
		what := fmt.Sprintf("consumer group %q's KeyParallelism %d", cfg.Group, lanes)
		if cfg.Concurrency > 0 {
			what = fmt.Sprintf("consumer group %q's Concurrency %d", cfg.Group, cfg.Concurrency)
		}
		return nil, r.poolTooSmall(need-avail, what)
	}
	cfg.Concurrency = cmp.Or(cfg.Concurrency, avail)

	c, err := consumer.New(cfg)
	if err != nil {
		return nil, err
	}
	e := &consumerEntry{c: c, group: cfg.Group, topics: cfg.Topics, dlq: cfg.DeadLetterTopic,
		brokers: cfg.Brokers, opts: cfg.ClientOpts}
	if e.dlq == nil {
		e.dlq = dlq.DefaultTopic
	}
	r.consumers = append(r.consumers, e)
	return c, nil
}

// A Worker is a consumer of another broker run beside the Kafka consumers:
// package natsconsumer's and package rabbitconsumer's Consumer are Workers.
type Worker interface {
	// Run consumes until ctx ends, then finishes or hands back what it
	// holds and returns. An error it returns before then stops the runner.
	Run(ctx context.Context) error
	// NotReady says why it does not consume right now, or "" when it
	// does; /readyz lists it.
	NotReady() string
}

// AddWorker adds w, named name in logs and /readyz (for example "jetstream
// ORDERS/order-worker"), to the components Run runs. It runs as a Kafka
// consumer does: it starts after the start-up checks, with the consumers;
// at shutdown its context ends with theirs, and Run waits for it to return
// before the relay flushes, so the outbox rows its last transactions
// committed are published. Give it the runner's Pool and Schema, and a
// shutdown budget that fits in Config.ShutdownTimeout less
// RelayFlushTimeout (the runner cannot see it). Its connection to its
// broker is its own: the runner checks no stream or queue; w's Run does.
func (r *Runner) AddWorker(name string, w Worker) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.addable("AddWorker"); err != nil {
		return err
	}
	switch {
	case name == "":
		return invalid("AddWorker", "a name is required (it names the worker in logs and /readyz)")
	case w == nil:
		return invalid("AddWorker", "worker %q is nil", name)
	}
	for _, e := range r.workers {
		if e.name == name {
			return invalid("AddWorker", "a worker named %q was added already", name)
		}
	}
	r.workers = append(r.workers, workerEntry{name, w})
	return nil
}

// Relay returns the relay of Config.Relay, or nil.
func (r *Runner) Relay() *outbox.Relay { return r.relay }

// Outbox returns the outbox in the runner's schema, for enqueuing messages
// in a caller's transaction.
func (r *Runner) Outbox() *outbox.Outbox { return r.outbox }

// Idempotency returns idempotency middleware in the runner's schema (and
// with its logger and providers), whose cleanup of expired keys Run runs
// with the other cleanups.
func (r *Runner) Idempotency(cfg idempotency.Config) (*idempotency.Middleware, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.addable("Idempotency"); err != nil {
		return nil, err
	}
	if err := r.sameSchema("idempotency.Config.Schema", &cfg.Schema); err != nil {
		return nil, err
	}
	cfg.Logger = cmp.Or(cfg.Logger, r.cfg.Logger)
	cfg.TracerProvider = cmp.Or(cfg.TracerProvider, r.cfg.TracerProvider)
	cfg.MeterProvider = cmp.Or(cfg.MeterProvider, r.cfg.MeterProvider)
	m, err := idempotency.New(r.cfg.Pool, cfg)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	r.loops = append(r.loops, loop{"idempotency cleanup", m.Run})
	return m, nil
}

// Webhook returns a webhook receiver that stores deliveries in the
// runner's outbox; its Pool, Logger and providers default to the runner's.
func (r *Runner) Webhook(cfg webhook.Config) (*webhook.Receiver, error) {
	if err := r.sameSchema("webhook.Config.Outbox.Schema", &cfg.Outbox.Schema); err != nil {
		return nil, err
	}
	if err := r.samePool("webhook.Config.Pool", &cfg.Pool); err != nil {
		return nil, err
	}
	cfg.Logger = cmp.Or(cfg.Logger, r.cfg.Logger)
	cfg.TracerProvider = cmp.Or(cfg.TracerProvider, r.cfg.TracerProvider)
	cfg.MeterProvider = cmp.Or(cfg.MeterProvider, r.cfg.MeterProvider)
	rc, err := webhook.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	return rc, nil
}

// AddDispatcher creates an outbound webhook dispatcher that Run runs next
// to the cleanups (it stops when the shutdown begins, after its own
// DrainTimeout). Its Store.Schema, Pool, Logger and providers default to
// the runner's. Enqueue deliveries with OutboundStore.
func (r *Runner) AddDispatcher(cfg outbound.DispatcherConfig) (*outbound.Dispatcher, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.addable("AddDispatcher"); err != nil {
		return nil, err
	}
	if err := r.sameSchema("outbound.DispatcherConfig.Store.Schema", &cfg.Store.Schema); err != nil {
		return nil, err
	}
	if err := r.samePool("outbound.DispatcherConfig.Pool", &cfg.Pool); err != nil {
		return nil, err
	}
	cfg.Logger = cmp.Or(cfg.Logger, r.cfg.Logger)
	cfg.TracerProvider = cmp.Or(cfg.TracerProvider, r.cfg.TracerProvider)
	cfg.MeterProvider = cmp.Or(cfg.MeterProvider, r.cfg.MeterProvider)
	d, err := outbound.NewDispatcher(cfg)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	r.loops = append(r.loops, loop{"outbound webhook dispatcher", d.Run})
	return d, nil
}

// OutboundStore returns the outbound webhook store in the runner's schema,
// for enqueuing deliveries in a caller's transaction.
func (r *Runner) OutboundStore() *outbound.Store { return r.outboundStore }

// Go adds a function Run runs next to the components, such as an outbound
// webhook dispatcher: it starts with them, its context ends when the
// shutdown begins, and Run waits for it. An error it returns before then
// stops the runner.
func (r *Runner) Go(name string, run func(ctx context.Context) error) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.addable("Go"); err != nil {
		return err
	}
	r.loops = append(r.loops, loop{name, run})
	return nil
}

// server is an HTTP server of AddServer; closed is closed once its listener
// is: intake has stopped. A nil ln.Listener is opened by Run on srv.Addr,
// which field names in errors.
type server struct {
	srv   *http.Server
	ln    *closeListener
	field string
}

func newServer(srv *http.Server, ln net.Listener, field string) *server {
	return &server{srv: srv, ln: &closeListener{Listener: ln, closed: make(chan struct{})}, field: field}
}

type closeListener struct {
	net.Listener
	once   sync.Once
	closed chan struct{}
}

func (l *closeListener) Close() error {
	err := l.Listener.Close()
	l.once.Do(func() { close(l.closed) })
	return err
}

// AddServer makes Run serve srv on ln from its start (so that /livez and
// /readyz answer while it migrates), and stop it first on the way out: the
// listener closes before the consumers are told to drain, and the requests
// in flight may finish until the relay's final flush.
//
// A nil ln makes Run listen on srv.Addr (":http" when empty) first thing:
// an address in use is Run's error, before anything starts.
func (r *Runner) AddServer(srv *http.Server, ln net.Listener) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.addable("AddServer"); err != nil {
		return err
	}
	r.servers = append(r.servers, newServer(srv, ln, "http.Server.Addr"))
	return nil
}

// listen opens the listeners Run serves that are not open yet; when one
// fails, it closes those it opened.
func (r *Runner) listen(ctx context.Context) error {
	for i, s := range r.servers {
		if s.ln.Listener != nil {
			continue
		}
		ln, err := new(net.ListenConfig).Listen(ctx, "tcp", cmp.Or(s.srv.Addr, ":http"))
		if err != nil {
			for _, o := range r.servers[:i] {
				_ = o.ln.Close()
			}
			return fmt.Errorf("oncely: %s: %w", s.field, err)
		}
		s.ln.Listener = ln
	}
	return nil
}

// Handle adds a route to Handler, and so to the server of Config.HTTPAddr:
// the application's API and webhook endpoints beside /livez, /readyz and
// /metrics. Patterns are http.ServeMux's, which panics on a conflicting one.
func (r *Runner) Handle(pattern string, h http.Handler) { r.mux.Handle(pattern, h) }

// Started reports whether Run got past its start-up (migrations, BeforeStart
// and the checks) and started the components. It stays true during the
// shutdown. Use it to gate routes that need the tables.
func (r *Runner) Started() bool { return r.started.Load() }
