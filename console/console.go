package console

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"crypto/subtle"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/internal/sqlident"
	"github.com/oncely/oncely/outbox"
	"github.com/oncely/oncely/webhook/outbound"
)

//go:embed assets
var assets embed.FS

// Config configures the console.
type Config struct {
	// Pool is the consumers' database: the inbox, the outbox and the
	// webhook tables. Required.
	Pool *pgxpool.Pool
	// Schema holds oncely's tables. Default "oncely".
	Schema string
	// KafkaOpts reach the Kafka cluster (seed brokers, TLS, SASL). Without
	// them the pages show no lag and no dead letters.
	KafkaOpts []kgo.Opt
	// DeadLetterTopics are the dead-letter topics shown. Default: every
	// topic whose name ends in ".dlq".
	DeadLetterTopics []string
	// JetStream reaches the NATS server of the JetStream consumers
	// (natsconsumer) on a connection the caller owns: jetstream.New(nc).
	// Without it the pages show no JetStream dead letters.
	JetStream jetstream.JetStream
	// Streams are the JetStream streams whose durable consumers the
	// overview shows (messages pending, ack pending, redelivered, with the
	// trend). Default: every stream but the dead-letter streams.
	Streams []string
	// DeadLetterStreams are the JetStream dead-letter streams shown.
	// Default: every stream whose subjects all start with "dlq." (where
	// natsconsumer.DefaultDeadLetterSubject puts dead letters); name them
	// when the consumers' DeadLetterSubject puts them elsewhere.
	DeadLetterStreams []string
	// AMQPURL reaches the RabbitMQ of the rabbitconsumer consumers
	// (amqp://user:password@host:5672/vhost): the console opens a
	// connection of its own for each listing and redrive of a dead-letter
	// queue, and closes it before the request ends. Without it the pages
	// show no RabbitMQ dead letters.
	AMQPURL string
	// DeadLetterQueues are the RabbitMQ dead-letter queues shown (each a
	// rabbitconsumer Config.DeadLetterQueue). Required with AMQPURL:
	// RabbitMQ cannot list its queues over AMQP (only its management
	// plugin can), so the console does not discover them.
	DeadLetterQueues []string
	// Queues are the RabbitMQ queues of the consumers (rabbitconsumer
	// Config.Queues) whose backlog the overview shows: messages ready and
	// consumers, with the trend. Default: the queue of each dead-letter
	// queue named by rabbitconsumer's default (DefaultDeadLetterRoutingKey:
	// the name without ".dlq").
	Queues []string
	// IDHeader is the dedup id header of redriven records and messages
	// (a natsconsumer's MessageIDHeader). Default "message-id".
	IDHeader string
	// Actions enables the actions (redrive, retry, discard, pause,
	// resume). Default false: read-only.
	Actions bool
	// Auth wraps every request: it rejects the unauthenticated and names
	// the operator with WithIdentity. Default: none (anyone who reaches
	// the handler; the identity is "anonymous").
	Auth func(http.Handler) http.Handler
	// Logger receives one line per action, with the operator's identity.
	// Default: discard.
	Logger *slog.Logger
	// InboxRetention is the inbox cleaner's retention (dedup.CleanerConfig),
	// shown beside the oldest inbox row: rows older than it plus an hour
	// are flagged, as no cleaner seems to run. Default 0: not shown.
	InboxRetention time.Duration
	// Ready, when the console is mounted in a service that has one (e.g.
	// oncely.Runner.Ready), says what of the service is not ready; the
	// overview lists its reasons (each error of an Unwrap() []error, or the
	// error) beside the console's own findings. Default: the console's own
	// findings only.
	Ready func() error
	// SampleInterval is how often Console.Run samples consumer lag (the
	// overview's trend) and reads what the dead-letter topics gained.
	// Default 15s.
	SampleInterval time.Duration
	// Timeout bounds each page's and each action's work. Default 15s.
	Timeout time.Duration
	// ViewWait bounds a page's wait for a dead-letter place to be read:
	// the first read of a topic or stream, a listing of a RabbitMQ queue
	// whose count changed. Past it the read goes on in the background and
	// the page shows what was read by then (of a queue: its last listing),
	// with a note that says so. A dry run waits for the whole read. Default
	// 150ms.
	ViewWait time.Duration
}

type identityKey struct{}

// WithIdentity returns r with the operator's name attached; Config.Auth
// calls it. Actions are logged with this name.
func WithIdentity(r *http.Request, who string) *http.Request {
	return r.WithContext(context.WithValue(r.Context(), identityKey{}, who))
}

// Identity returns the operator's name set by WithIdentity, or "anonymous".
func Identity(ctx context.Context) string {
	if who, ok := ctx.Value(identityKey{}).(string); ok && who != "" {
		return who
	}
	return "anonymous"
}

// tokenCookie holds the bearer token of a browser that signed in with
// ?token=.
const tokenCookie = "oncely_console_token"

// BearerToken is an Auth that admits requests carrying token as
// "Authorization: Bearer <token>", or in a cookie set by opening any page
// once with ?token=<token> (the browser is then redirected to the same page
// without it). The identity is "token".
func BearerToken(token string) (func(http.Handler) http.Handler, error) {
	if len(token) < 16 {
		return nil, errors.New("console: bearer token: at least 16 characters")
	}
	want := []byte(token)
	ok := func(got string) bool { return subtle.ConstantTimeCompare([]byte(got), want) == 1 }
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if q := r.URL.Query(); q.Has("token") && r.Method == http.MethodGet {
				if !ok(q.Get("token")) {
					http.Error(w, "wrong token", http.StatusUnauthorized)
					return
				}
				http.SetCookie(w, &http.Cookie{Name: tokenCookie, Value: token, Path: "/", HttpOnly: true,
					SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil})
				q.Del("token")
				redirect(w, lastSegment(r.URL.Path), q)
				return
			}
			got, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
			if c, err := r.Cookie(tokenCookie); got == "" && err == nil {
				got = c.Value
			}
			if !ok(got) {
				w.Header().Set("WWW-Authenticate", `Bearer realm="oncely console"`)
				http.Error(w, "unauthorized: send Authorization: Bearer <token>, or open the console once with ?token=<token>", http.StatusUnauthorized)
				return
			}
			next.ServeHTTP(w, WithIdentity(r, "token"))
		})
	}, nil
}

// Console is the console's handler. Run, optional, keeps its lag trend
// and dead-letter index current between views.
type Console struct {
	http.Handler
	s *server
}

// Run samples consumer lag and brings the dead-letter index (Kafka's
// topics, JetStream's streams) up to date every Config.SampleInterval
// until ctx is done, then returns nil once the read of a place it waits
// for has ended, or its round has run Config.Timeout; it lists a RabbitMQ dead-letter
// queue again (the pages' snapshot of it) when its count changed, or its
// snapshot is a minute old. Without Run the pages do all this when
// viewed: the lag trend then has the overview's views as its samples, and
// the first view of a dead-letter topic, stream or queue starts reading it
// whole, waits for that a bounded time, and shows what was read by then
// with a note. A failed round is logged and the next one tried.
func (c *Console) Run(ctx context.Context) error {
	s := c.s
	if len(s.cfg.KafkaOpts) == 0 && !s.otherBrokers() { // nothing to sample
		<-ctx.Done()
		return nil
	}
	t := time.NewTicker(s.cfg.SampleInterval)
	defer t.Stop()
	for {
		if err := s.sample(ctx); err != nil && ctx.Err() == nil {
			s.log.Warn("console: sample", "err", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// sample is one round of Run.
func (s *server) sample(run context.Context) error {
	// The round waits for its reads of places on a context of their own,
	// which Run's end does not cut short: stopped while it waits for one,
	// Run returns after that read has ended, not while it goes on. Past
	// the round's Timeout the round stops waiting (the read goes on in the
	// background, within a Timeout of its own), as it did before.
	reads, cancelReads := context.WithTimeout(context.WithoutCancel(run), s.cfg.Timeout)
	defer cancelReads()
	ctx, cancel := context.WithTimeout(run, s.cfg.Timeout)
	defer cancel()
	var err error
	if len(s.cfg.KafkaOpts) > 0 {
		_, err = s.lag(ctx)
	}
	if s.rabbit != nil {
		_, rerr := s.rabbitLag(ctx)
		err = errors.Join(err, rerr)
	}
	if s.jetstream != nil {
		_, jerr := s.jetStreamLag(ctx)
		err = errors.Join(err, jerr)
	}
	for _, src := range s.sources() {
		places, perr := src.places(ctx)
		err = errors.Join(err, perr)
		for _, p := range places {
			if run.Err() != nil {
				break // stopped: no new read
			}
			// Up to date (a RabbitMQ queue listed only when its snapshot
			// is stale), in the background the views share.
			if _, _, serr := src.view(reads, p, 0); serr != nil {
				err = errors.Join(err, serr)
			}
		}
	}
	return err
}

// server is the console's state.
type server struct {
	cfg    Config
	schema string
	inbox  *dedup.Inbox
	outbox *outbox.Outbox
	hooks  *outbound.Store
	tables struct{ inbox, outbox, deliveries string }
	dlq    *dlqIndex // Kafka's dead-letter topics
	// jetstream is JetStream's dead-letter streams; nil without
	// Config.JetStream.
	jetstream *jetStreamSource
	// rabbit is RabbitMQ's dead-letter queues; nil without Config.AMQPURL.
	rabbit *rabbitSource

	lagHistory lagHistory
	// rabbitQueues are the RabbitMQ queues whose backlog the overview
	// shows (Config.Queues); the histories are the other brokers'
	// backlog samples.
	rabbitQueues                    []string
	rabbitHistory, jetStreamHistory lagHistory
	tmpl                            *template.Template
	log                             *slog.Logger
}

// New returns the console's handler. Mount it under a prefix with
// http.StripPrefix, e.g. mux.Handle("/ops/", http.StripPrefix("/ops", h)).
func New(cfg Config) (*Console, error) {
	if cfg.Pool == nil {
		return nil, errors.New("console: Config.Pool: required")
	}
	if cfg.Timeout < 0 {
		return nil, errors.New("console: Config.Timeout: must not be negative")
	}
	if cfg.SampleInterval < 0 {
		return nil, errors.New("console: Config.SampleInterval: must not be negative")
	}
	if cfg.ViewWait < 0 {
		return nil, errors.New("console: Config.ViewWait: must not be negative")
	}
	if cfg.InboxRetention < 0 {
		return nil, errors.New("console: Config.InboxRetention: must not be negative")
	}
	s := &server{cfg: cfg, schema: cmp.Or(cfg.Schema, sqlident.DefaultSchema),
		log: cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))}
	s.cfg.Timeout = cmp.Or(cfg.Timeout, 15*time.Second)
	s.cfg.SampleInterval = cmp.Or(cfg.SampleInterval, 15*time.Second)
	s.cfg.ViewWait = cmp.Or(cfg.ViewWait, 150*time.Millisecond)
	s.dlq = &dlqIndex{opts: cfg.KafkaOpts}
	if cfg.JetStream != nil {
		s.jetstream = &jetStreamSource{js: cfg.JetStream, streams: cfg.DeadLetterStreams, timeout: s.cfg.Timeout}
	} else if len(cfg.DeadLetterStreams) > 0 {
		return nil, errors.New("console: Config.DeadLetterStreams: needs Config.JetStream")
	} else if len(cfg.Streams) > 0 {
		return nil, errors.New("console: Config.Streams: needs Config.JetStream")
	}
	switch {
	case cfg.AMQPURL != "" && len(cfg.DeadLetterQueues) == 0:
		return nil, errors.New("console: Config.DeadLetterQueues: required with Config.AMQPURL (RabbitMQ cannot list its queues over AMQP)")
	case cfg.AMQPURL == "" && len(cfg.Queues) > 0:
		return nil, errors.New("console: Config.Queues: needs Config.AMQPURL")
	case cfg.AMQPURL == "" && len(cfg.DeadLetterQueues) > 0:
		return nil, errors.New("console: Config.DeadLetterQueues: needs Config.AMQPURL")
	case cfg.AMQPURL != "":
		if _, err := amqp.ParseURI(cfg.AMQPURL); err != nil {
			// Not err: a URL that does not parse is quoted whole, password and all.
			return nil, fmt.Errorf("console: Config.AMQPURL: %s is not an AMQP URL (amqp://user:password@host:5672/vhost)", outbound.RedactURL(cfg.AMQPURL))
		}
		if slices.Contains(cfg.DeadLetterQueues, "") {
			return nil, errors.New("console: Config.DeadLetterQueues: a queue name is empty")
		}
		s.rabbit = newRabbitSource(cfg.AMQPURL, cfg.DeadLetterQueues, s.cfg.Timeout)
		s.rabbitQueues = slices.Clone(cfg.Queues)
		if len(s.rabbitQueues) == 0 {
			for _, q := range s.rabbit.queues {
				if src, ok := strings.CutSuffix(q, ".dlq"); ok && src != "" {
					s.rabbitQueues = append(s.rabbitQueues, src)
				}
			}
		}
		if slices.Contains(s.rabbitQueues, "") {
			return nil, errors.New("console: Config.Queues: a queue name is empty")
		}
	}
	var err error
	if s.inbox, err = dedup.New(dedup.Config{Schema: s.schema}); err != nil {
		return nil, errors.New("console: Config.Schema: " + err.Error())
	}
	if s.outbox, err = outbox.New(outbox.Config{Schema: s.schema}); err != nil {
		return nil, err
	}
	if s.hooks, err = outbound.NewStore(outbound.Config{Schema: s.schema}); err != nil {
		return nil, err
	}
	s.tables.inbox = sqlident.Table(s.schema, "inbox")
	s.tables.outbox = sqlident.Table(s.schema, "outbox")
	s.tables.deliveries = sqlident.Table(s.schema, "webhook_deliveries")
	if s.tmpl, err = template.New("").Funcs(funcs).ParseFS(assets, "assets/*.html"); err != nil {
		return nil, err
	}
	static, _ := fs.Sub(assets, "assets")

	mux := http.NewServeMux()
	mux.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(static)))
	mux.HandleFunc("GET /{$}", s.page(s.overview))
	mux.HandleFunc("GET /dlq", s.page(s.deadLetters))
	mux.HandleFunc("GET /record", s.page(s.record))
	mux.HandleFunc("GET /dlq-confirm", s.page(s.dlqConfirm))
	mux.HandleFunc("GET /outbox", s.page(s.outboxPage))
	mux.HandleFunc("GET /inbox", s.page(s.inboxPage))
	mux.HandleFunc("GET /webhooks", s.page(s.webhooksPage))
	mux.HandleFunc("POST /dlq-redrive", s.action(s.dlqRedrive))
	mux.HandleFunc("POST /outbox-retry", s.action(s.outboxRetry))
	mux.HandleFunc("POST /outbox-discard", s.action(s.outboxDiscard))
	mux.HandleFunc("POST /webhooks-pause", s.action(s.webhookPause))
	mux.HandleFunc("POST /webhooks-resume", s.action(s.webhookResume))
	mux.HandleFunc("POST /webhooks-redrive", s.action(s.webhookRedrive))

	var h http.Handler = mux
	h = securityHeaders(h)
	if cfg.Auth != nil {
		h = cfg.Auth(h)
	}
	return &Console{Handler: h, s: s}, nil
}

func securityHeaders(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		// Nothing from any other origin, no framing, no inline script.
		h.Set("Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'")
		h.Set("X-Frame-Options", "DENY")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "no-referrer")
		h.Set("Cache-Control", "no-store")
		next.ServeHTTP(w, r)
	})
}

// csrfCookie is the double-submit cookie: every form carries its value.
const csrfCookie = "oncely_console_csrf"

// csrfToken returns the request's CSRF token, setting the cookie when the
// browser has none.
func csrfToken(w http.ResponseWriter, r *http.Request) string {
	if c, err := r.Cookie(csrfCookie); err == nil && len(c.Value) == 64 {
		return c.Value
	}
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	tok := hex.EncodeToString(b)
	http.SetCookie(w, &http.Cookie{Name: csrfCookie, Value: tok, Path: "/", HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil})
	return tok
}

// view is what every page's template gets.
type view struct {
	Title   string
	Nav     string
	Actions bool
	CSRF    string
	Who     string
	Done    string // the outcome of the action just taken
	Err     string
	Data    any
}

type pageFunc func(ctx context.Context, r *http.Request, v *view) (tmpl string, err error)

func (s *server) page(f pageFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), s.cfg.Timeout)
		defer cancel()
		v := &view{Actions: s.cfg.Actions, CSRF: csrfToken(w, r), Who: Identity(r.Context()), Done: r.URL.Query().Get("done")}
		name, err := f(ctx, r, v)
		if err != nil {
			v.Err = err.Error()
		}
		// Rendered whole before anything is sent: a template error is a 500,
		// never a page cut short.
		var buf bytes.Buffer
		if err := s.tmpl.ExecuteTemplate(&buf, name, v); err != nil {
			s.log.Error("console: render", "page", name, "err", err)
			http.Error(w, "console: cannot render "+name+": "+err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		if be := (badRequest{}); errors.As(err, &be) {
			w.WriteHeader(http.StatusBadRequest)
		}
		_, _ = buf.WriteTo(w)
	}
}

// badRequest is an error in what the request asked for (400).
type badRequest struct{ msg string }

func (e badRequest) Error() string { return e.msg }

// actionFunc performs an action and returns where to go next (a page name
// and its query) and what was done, for the log and the page.
type actionFunc func(ctx context.Context, r *http.Request) (page string, q url.Values, done string, logArgs []any, err error)

func (s *server) action(f actionFunc) http.HandlerFunc {
	cop := http.NewCrossOriginProtection()
	return func(w http.ResponseWriter, r *http.Request) {
		if !s.cfg.Actions {
			http.Error(w, "actions are disabled: the console is read-only (enable actions to change anything)", http.StatusForbidden)
			return
		}
		if err := cop.Check(r); err != nil {
			http.Error(w, "refused: cross-origin request", http.StatusForbidden)
			return
		}
		c, err := r.Cookie(csrfCookie)
		if err := r.ParseForm(); err != nil {
			http.Error(w, "bad form: "+err.Error(), http.StatusBadRequest)
			return
		}
		if err != nil || len(c.Value) != 64 || subtle.ConstantTimeCompare([]byte(c.Value), []byte(r.PostForm.Get("csrf"))) != 1 {
			http.Error(w, "refused: missing or wrong CSRF token (reload the page and try again)", http.StatusForbidden)
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), s.cfg.Timeout)
		defer cancel()
		who := Identity(r.Context())
		page, q, done, args, err := f(ctx, r)
		if err != nil {
			s.log.Warn("console: action failed", append([]any{"action", r.URL.Path, "who", who, "err", err}, args...)...)
			code := http.StatusInternalServerError
			var be badRequest
			if errors.As(err, &be) {
				code = http.StatusBadRequest
			}
			http.Error(w, err.Error(), code)
			return
		}
		s.log.Info("console: action", append([]any{"action", strings.TrimPrefix(r.URL.Path, "/"), "who", who, "done", done}, args...)...)
		if q == nil {
			q = url.Values{}
		}
		q.Set("done", done)
		redirect(w, page, q)
	}
}

// redirect answers 303 with a relative Location, so that it holds under
// any mount prefix (http.Redirect would resolve it against the stripped
// path).
func redirect(w http.ResponseWriter, page string, q url.Values) {
	loc := cmp.Or(page, "./")
	if len(q) > 0 {
		loc += "?" + q.Encode()
	}
	w.Header().Set("Location", loc)
	w.WriteHeader(http.StatusSeeOther)
}

func lastSegment(p string) string {
	return p[strings.LastIndex(p, "/")+1:]
}
