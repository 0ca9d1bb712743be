package idempotency

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"net/textproto"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/oncely/oncely/internal/sqlident"
	"github.com/oncely/oncely/internal/telemetry"
)

// DB is what the middleware needs from Postgres; *pgxpool.Pool satisfies it.
// Every request the middleware handles holds one connection from Begin until
// its response is recorded, so the pool size bounds how many keyed requests
// run at once.
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Defaults of Config.
const (
	DefaultHeader           = "Idempotency-Key"
	DefaultMaxKeyLength     = 255
	DefaultMaxBodyBytes     = 1 << 20
	DefaultMaxResponseBytes = 1 << 20
	DefaultTTL              = 24 * time.Hour
	DefaultRetryAfter       = time.Second
	DefaultCommitTimeout    = 10 * time.Second
	DefaultCleanupBatchSize = 1000
	DefaultCleanupInterval  = time.Minute
)

// DefaultReplayHeaders returns the default of Config.ReplayHeaders: the
// headers that describe the recorded body and the resource the request
// created, none of which carries a credential or a hop-by-hop meaning.
func DefaultReplayHeaders() []string {
	return []string{
		"Content-Type", "Content-Encoding", "Content-Language", "Content-Disposition", "Content-Location",
		"Location", "ETag", "Last-Modified", "Link",
	}
}

// notReplayable are the headers Config.ReplayHeaders refuses: framing and
// hop-by-hop headers (RFC 9110 section 7.6.1), and the middleware's own.
var notReplayable = map[string]bool{
	"Content-Length": true, "Transfer-Encoding": true, "Connection": true, "Keep-Alive": true,
	"Proxy-Connection": true, "Proxy-Authenticate": true, "Proxy-Authorization": true,
	"Te": true, "Trailer": true, "Upgrade": true, ReplayedHeader: true,
}

// ReplayedHeader marks a response replayed from the table.
const ReplayedHeader = "Idempotent-Replayed"

// Limits on Config values.
const (
	// MaxKeyLengthLimit is the largest Config.MaxKeyLength: (scope, key) must
	// fit a btree index entry.
	MaxKeyLengthLimit = 1024
	// MaxBytesLimit is the largest Config.MaxBodyBytes and
	// Config.MaxResponseBytes: a bytea value holds at most 1 GiB.
	MaxBytesLimit = 1<<30 - 1
)

// Config configures a Middleware. Every field is optional.
type Config struct {
	// Schema holds the idempotency_keys table (created by package
	// migrations). Default "oncely". Postgres store (New) only.
	Schema string
	// Header is the request header that carries the key. Default
	// "Idempotency-Key".
	Header string
	// MaxKeyLength bounds a key, in bytes. Default 255, at most 1024.
	MaxKeyLength int
	// Methods lists the request methods the middleware applies to; requests
	// with other methods pass through untouched. Default POST and PATCH.
	Methods []string
	// Scope names the client a request comes from: the keys of two clients
	// are independent, so two clients that pick the same key get two
	// requests, and neither can ever be replayed the other's response. It
	// runs after the handlers wrapped around the middleware (e.g.
	// authentication) and must return a non-empty name; a keyed request
	// it names no client for ("") is refused with 401 and does not run.
	// Default: the client that the request's context names through
	// [WithClient] (set by your authentication middleware).
	Scope func(r *http.Request) string
	// GlobalScope puts every client's keys in one key space: two clients
	// that send the same key and request get one effect, and the second
	// gets the first one's response. Only for an API with a single client,
	// or one whose clients share their keys on purpose. It excludes Scope.
	// Default false: keys are per client (see Scope).
	GlobalScope bool
	// IgnoreQuery leaves the raw query string out of the request
	// fingerprint, for APIs whose query never changes what a request does.
	// Default false: a key reused with another query gets 422.
	IgnoreQuery bool
	// MaxBodyBytes bounds the request body read for the fingerprint; larger
	// bodies get 413. Default 1 MiB.
	MaxBodyBytes int64
	// MaxResponseBytes bounds the response body the handler may write;
	// beyond it the request is rolled back and answered 500. Default 1 MiB.
	MaxResponseBytes int64
	// ReplayHeaders lists the response headers recorded and replayed along
	// with the status and body. Default [DefaultReplayHeaders]. Headers not
	// listed reach the first client only; Set-Cookie in particular is
	// replayed only when listed. Content-Length is always derived from the
	// body; hop-by-hop headers (Connection, Keep-Alive, Proxy-*, TE,
	// Trailer, Transfer-Encoding, Upgrade) are refused, and a header that
	// the response's Connection header names is never recorded.
	ReplayHeaders []string
	// StoreStatus decides which final statuses are recorded. A response
	// that is not recorded is not committed either: the handler's writes
	// are rolled back with the key (Postgres store; with another store they
	// stay), and a retry runs the handler afresh. Default
	// DefaultStoreStatus.
	StoreStatus func(status int) bool
	// TTL is how long a recorded response is replayed, counted from the
	// start of the first request's transaction (or claim, with another
	// store; the Redis store keeps a response at least its LockTTL from the
	// record); after it the key is free again. It should exceed the
	// longest time clients keep retrying. Default 24 hours, at least one
	// second.
	TTL time.Duration
	// RetryAfter is sent with 409 (key in progress) and 503 (store
	// unavailable), rounded up to whole seconds. Default 1 second.
	RetryAfter time.Duration
	// CommitTimeout bounds recording the response and committing. These run
	// even if the client has gone away (its retry then gets the replay).
	// Default 10 seconds.
	CommitTimeout time.Duration
	// CleanupBatchSize bounds the rows DeleteExpired deletes per statement.
	// Default 1000. Postgres store only, as CleanupInterval.
	CleanupBatchSize int
	// CleanupInterval is the pause between passes of Run. Default 1 minute.
	CleanupInterval time.Duration
	// Logger receives database failures and cleanup passes. Default: discard.
	Logger *slog.Logger
	// TracerProvider and MeterProvider instrument the middleware: a
	// SpanRequest span per request of Methods, with its outcome (stored,
	// replayed, conflict, mismatch...), and the MetricRequests and
	// MetricDuration metrics. Default: the global providers.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider
}

// DefaultStoreStatus records every final status below 500 except those that
// ask the client to try again later (408, 409, 425, 429): recording those
// would answer "try again later" for the whole TTL.
func DefaultStoreStatus(status int) bool {
	switch status {
	case http.StatusRequestTimeout, http.StatusConflict, http.StatusTooEarly, http.StatusTooManyRequests:
		return false
	}
	return status >= 200 && status < 500
}

// Middleware makes keyed requests take effect once. Create it with New and
// wrap handlers with Handler or Require.
type Middleware struct {
	store      Store
	pg         *pgStore // the store of New; nil for NewWithStore
	cfg        Config
	methods    map[string]*methodTel // Config.Methods, with their telemetry
	replay     map[string]bool       // canonical header names
	retryAfter string
	hooks      hooks
	tel        *telemetry.Requests
}

// hooks are the test-only crash points (set through export_test.go).
type hooks struct {
	// afterCommit runs after the response was committed and before it is
	// written; an error makes the middleware abort the connection as if the
	// process died there.
	afterCommit func(r *http.Request) error
}

// New validates cfg, fills in its defaults and builds the SQL of the
// Postgres store: keys live in the idempotency_keys table of Config.Schema,
// and the handler's writes through [Tx] commit with the response.
func New(db DB, cfg Config) (*Middleware, error) {
	if db == nil {
		return nil, errors.New("idempotency: db is nil")
	}
	cfg.Schema = cmp.Or(cfg.Schema, sqlident.DefaultSchema)
	if err := sqlident.ValidateSchema("idempotency: Config.Schema", cfg.Schema); err != nil {
		return nil, err
	}
	pg := newPGStore(db, cfg.Schema)
	return newMiddleware(pg, pg, cfg)
}

// NewWithStore is New with another Store, such as package
// idempotency/redisstore's. Config.Schema and the cleanup settings do not
// apply (the store expires its keys itself), [Tx] reports false in the
// handler, and the handler's effects are not undone with the key: see the
// store's documentation for what it guarantees.
func NewWithStore(store Store, cfg Config) (*Middleware, error) {
	if store == nil {
		return nil, errors.New("idempotency: store is nil")
	}
	return newMiddleware(store, nil, cfg)
}

func newMiddleware(store Store, pg *pgStore, cfg Config) (*Middleware, error) {
	if cfg.GlobalScope && cfg.Scope != nil {
		return nil, errors.New("idempotency: Config.GlobalScope and Config.Scope are both set: keys are either per client (Scope) or shared by all clients (GlobalScope)")
	}
	cfg.Header = cmp.Or(cfg.Header, DefaultHeader)
	if !validToken(cfg.Header) {
		return nil, fmt.Errorf("idempotency: Config.Header: %q is not a valid header name", cfg.Header)
	}
	if cfg.MaxKeyLength < 0 || cfg.MaxKeyLength > MaxKeyLengthLimit {
		return nil, fmt.Errorf("idempotency: Config.MaxKeyLength: %d is outside [0, %d] (0: default %d)", cfg.MaxKeyLength, MaxKeyLengthLimit, DefaultMaxKeyLength)
	}
	cfg.MaxKeyLength = cmp.Or(cfg.MaxKeyLength, DefaultMaxKeyLength)
	if cfg.Methods == nil {
		cfg.Methods = []string{http.MethodPost, http.MethodPatch}
	}
	if len(cfg.Methods) == 0 {
		return nil, errors.New("idempotency: Config.Methods: empty (nil: default POST and PATCH)")
	}
	for _, m := range cfg.Methods {
		if !validToken(m) {
			return nil, fmt.Errorf("idempotency: Config.Methods: %q is not a valid method", m)
		}
	}
	for name, v := range map[string]*int64{"MaxBodyBytes": &cfg.MaxBodyBytes, "MaxResponseBytes": &cfg.MaxResponseBytes} {
		if *v < 0 || *v > MaxBytesLimit {
			return nil, fmt.Errorf("idempotency: Config.%s: %d is outside [0, %d] (0: default 1 MiB)", name, *v, MaxBytesLimit)
		}
	}
	cfg.MaxBodyBytes = cmp.Or(cfg.MaxBodyBytes, DefaultMaxBodyBytes)
	cfg.MaxResponseBytes = cmp.Or(cfg.MaxResponseBytes, DefaultMaxResponseBytes)
	if cfg.ReplayHeaders == nil {
		cfg.ReplayHeaders = DefaultReplayHeaders()
	}
	replay := make(map[string]bool, len(cfg.ReplayHeaders))
	for _, h := range cfg.ReplayHeaders {
		if !validToken(h) {
			return nil, fmt.Errorf("idempotency: Config.ReplayHeaders: %q is not a valid header name", h)
		}
		c := textproto.CanonicalMIMEHeaderKey(h)
		if notReplayable[c] {
			return nil, fmt.Errorf("idempotency: Config.ReplayHeaders: %s is a hop-by-hop or framing header, or set by the middleware; it cannot be replayed", c)
		}
		replay[c] = true
	}
	if cfg.StoreStatus == nil {
		cfg.StoreStatus = DefaultStoreStatus
	}
	if cfg.TTL < 0 || (cfg.TTL > 0 && cfg.TTL < time.Second) {
		return nil, fmt.Errorf("idempotency: Config.TTL: %s is below one second (0: default %s)", cfg.TTL, DefaultTTL)
	}
	cfg.TTL = cmp.Or(cfg.TTL, DefaultTTL)
	for name, v := range map[string]time.Duration{"RetryAfter": cfg.RetryAfter, "CommitTimeout": cfg.CommitTimeout, "CleanupInterval": cfg.CleanupInterval} {
		if v < 0 {
			return nil, fmt.Errorf("idempotency: Config.%s: %s is negative", name, v)
		}
	}
	if cfg.CleanupBatchSize < 0 {
		return nil, fmt.Errorf("idempotency: Config.CleanupBatchSize: %d is negative", cfg.CleanupBatchSize)
	}
	cfg.RetryAfter = cmp.Or(cfg.RetryAfter, DefaultRetryAfter)
	cfg.CommitTimeout = cmp.Or(cfg.CommitTimeout, DefaultCommitTimeout)
	cfg.CleanupBatchSize = cmp.Or(cfg.CleanupBatchSize, DefaultCleanupBatchSize)
	cfg.CleanupInterval = cmp.Or(cfg.CleanupInterval, DefaultCleanupInterval)
	cfg.Logger = cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))

	tel, err := newInstruments(&cfg)
	if err != nil {
		return nil, err
	}
	methods := make(map[string]*methodTel, len(cfg.Methods))
	for _, m := range cfg.Methods {
		methods[m] = newMethodTel(tel, m)
	}
	return &Middleware{
		tel:        tel,
		store:      store,
		pg:         pg,
		cfg:        cfg,
		methods:    methods,
		replay:     replay,
		retryAfter: strconv.FormatInt(int64(math.Ceil(cfg.RetryAfter.Seconds())), 10),
	}, nil
}

// Handler wraps next: a request with a key (and one of Config.Methods) takes
// effect once per key; a request without a key passes through untouched, and
// Tx reports false in it.
func (m *Middleware) Handler(next http.Handler) http.Handler { return m.wrap(next, false) }

// Require wraps next like Handler, but a request with one of Config.Methods
// and no key is refused with 400.
func (m *Middleware) Require(next http.Handler) http.Handler { return m.wrap(next, true) }

func (m *Middleware) wrap(next http.Handler, required bool) http.Handler {
	if next == nil {
		panic("idempotency: nil handler")
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mt := m.methods[r.Method]
		if mt == nil {
			next.ServeHTTP(w, r)
			return
		}
		start := time.Now()
		ctx, span := m.tel.StartWith(r.Context(), SpanRequest, mt.spanOpts)
		// What a panic (of the handler, or the simulated crash) leaves.
		res := result{outcome: OutcomeAborted, err: errAborted}
		defer func() {
			var spanAttrs []attribute.KeyValue
			if span.IsRecording() {
				spanAttrs = res.spanAttributes()
			}
			m.tel.EndMeasure(ctx, span, start, mt.measure(m.tel, res), spanAttrs, res.err, res.outcome)
		}()
		res = m.serve(ctx, w, r, next, required)
	})
}

// Header returns the name of the request header that carries the key
// (Config.Header).
func (m *Middleware) Header() string { return m.cfg.Header }

// MaxKeyLength returns the longest key accepted, in bytes
// (Config.MaxKeyLength).
func (m *Middleware) MaxKeyLength() int { return m.cfg.MaxKeyLength }

// Schema returns the schema of the idempotency_keys table ("" under
// NewWithStore).
func (m *Middleware) Schema() string { return m.cfg.Schema }

type ctxKey struct{}

type txKey struct{}

type request struct {
	scope, key string
}

// Tx returns the transaction of the keyed request that ctx belongs to. The
// handler's writes through it commit together with the recorded response,
// or not at all. The middleware owns it: its Commit and Rollback return
// ErrTxOwned (use a savepoint, tx.Begin, to undo part of the work; answer a
// status that is not stored, such as a 5xx, to undo all of it). Only the
// Postgres store (New) has one: under NewWithStore Tx reports false.
func Tx(ctx context.Context) (pgx.Tx, bool) {
	tx, ok := ctx.Value(txKey{}).(pgx.Tx)
	return tx, ok
}

// Key returns the scope and key of the keyed request that ctx belongs to,
// e.g. to derive a stable message id for an outbox message.
func Key(ctx context.Context) (scope, key string, ok bool) {
	req, ok := ctx.Value(ctxKey{}).(*request)
	if !ok {
		return "", "", false
	}
	return req.scope, req.key, true
}

// ErrTxOwned is returned by Commit and Rollback of the transaction Tx gives
// a handler: the middleware commits it with the response, or rolls it back.
var ErrTxOwned = errors.New("idempotency: the request's transaction is committed or rolled back by the middleware")

// ownedTx is the handler's view of the request's transaction.
type ownedTx struct{ pgx.Tx }

func (ownedTx) Commit(context.Context) error   { return ErrTxOwned }
func (ownedTx) Rollback(context.Context) error { return ErrTxOwned }

// errAborted is the error of a request whose handler panicked, or whose
// connection was aborted.
var errAborted = errors.New("idempotency: the request was aborted (a panic)")

// refuse answers a request refused before its key was claimed.
func refuse(w http.ResponseWriter, status int, reason, detail string) result {
	problem(w, status, detail)
	return result{outcome: OutcomeRefused, refusal: reason, status: status}
}

// serve handles a request of Config.Methods; ctx is r's context with the
// request's span. r itself is left as it came (but for its body, read to
// the end): the handler gets a copy with ctx and the body to read again,
// and a request answered without the handler (a replay, a refusal) costs
// no copy.
func (m *Middleware) serve(ctx context.Context, w http.ResponseWriter, r *http.Request, next http.Handler, required bool) result {
	values := r.Header.Values(m.cfg.Header)
	if len(values) == 0 {
		if required {
			return refuse(w, http.StatusBadRequest, RefusalMissingKey, "this endpoint requires an "+m.cfg.Header+" header")
		}
		next.ServeHTTP(w, r.WithContext(ctx))
		return result{outcome: OutcomeNoKey}
	}
	key, err := parseKey(values, m.cfg.MaxKeyLength)
	if err != nil {
		return refuse(w, http.StatusBadRequest, RefusalInvalidKey, m.cfg.Header+": "+err.Error())
	}
	scope, res, ok := m.scope(ctx, w, r)
	if !ok {
		return res
	}

	// The body is read once, bounded, and hashed as received; the handler
	// gets it again (run), and otherwise its buffer is reused.
	body, err := readBody(http.MaxBytesReader(w, r.Body, m.cfg.MaxBodyBytes), r.ContentLength, m.cfg.MaxBodyBytes)
	if err != nil {
		if mbe := (*http.MaxBytesError)(nil); errors.As(err, &mbe) {
			return refuse(w, http.StatusRequestEntityTooLarge, RefusalBodyTooLarge, fmt.Sprintf("the request body exceeds %d bytes", m.cfg.MaxBodyBytes))
		}
		return refuse(w, http.StatusBadRequest, RefusalBodyUnreadable, "could not read the request body")
	}
	fp := fingerprint(r.Method, r.URL.EscapedPath(), !m.cfg.IgnoreQuery, r.URL.RawQuery, body.b)
	return m.run(ctx, w, r, next, scope, key, fp, body)
}

// scope returns the key space of a keyed request, or answers it and returns
// what became of it and false: 401 when it names no client, 500 when the
// name cannot be stored.
func (m *Middleware) scope(ctx context.Context, w http.ResponseWriter, r *http.Request) (string, result, bool) {
	if m.cfg.GlobalScope {
		return "", result{}, true
	}
	var scope string
	if m.cfg.Scope != nil {
		scope = m.cfg.Scope(r.WithContext(ctx))
	} else {
		scope, _ = Client(ctx)
	}
	if scope == "" {
		how := "no idempotency.WithClient in the request context"
		if m.cfg.Scope != nil {
			how = "Config.Scope returned an empty name"
		}
		m.cfg.Logger.InfoContext(ctx, "oncely idempotency: keyed request refused: it names no client", "reason", how)
		return "", refuse(w, http.StatusUnauthorized, RefusalNoClient,
			"the request names no client, so its "+m.cfg.Header+" cannot be scoped; authenticate"), false
	}
	if err := checkScope(scope); err != nil {
		m.cfg.Logger.ErrorContext(ctx, "oncely idempotency: bad scope", "err", err)
		problem(w, http.StatusInternalServerError, "the request was not processed")
		return "", result{outcome: OutcomeFailed, status: http.StatusInternalServerError, err: err}, false
	}
	return scope, result{}, true
}

type clientKey struct{}

// WithClient returns ctx naming client as the sender of the request: the
// middleware's default Config.Scope. Call it in your authentication
// middleware, wrapped around the idempotency middleware, with the verified
// principal (an account or API-key id, never a value the client chose
// without proving it).
func WithClient(ctx context.Context, client string) context.Context {
	return context.WithValue(ctx, clientKey{}, client)
}

// Client returns the client that WithClient named in ctx.
func Client(ctx context.Context) (string, bool) {
	c, ok := ctx.Value(clientKey{}).(string)
	return c, ok && c != ""
}

// run is the whole life of a keyed request. With the Postgres store (New)
// it is one transaction:
//
//	BEGIN
//	  claim: try the key's advisory lock, INSERT the key row   -- first statement
//	    lock busy          -> 409 (another request holds the key right now)
//	    committed row      -> ROLLBACK; same fingerprint: replay, else 422
//	  handler(tx)           -- its writes, captured response
//	  status not stored    -> ROLLBACK, pass the response through
//	  UPDATE the key row with status, headers, body
//	COMMIT
//	write the response
//
// A crash anywhere before COMMIT rolls everything back (the key too), so the
// retry runs afresh; a crash after COMMIT leaves a row whose replay is the
// response the client missed. Other stores follow the same steps through
// the Store interface: claim, handler, record or release.
func (m *Middleware) run(ctx context.Context, w http.ResponseWriter, r *http.Request, next http.Handler, scope, key string, fp []byte, body bodyBuf) result {
	claim, err := m.store.Claim(ctx, scope, key, fp, m.cfg.TTL)
	if err == nil && claim.State == ClaimTaken && claim.Lease == nil {
		err = errors.New("the store returned ClaimTaken without a Lease")
	}
	if err != nil || claim.State != ClaimTaken {
		body.free() // the handler does not run: nothing else holds the body
		switch {
		case err != nil:
			return m.unavailable(ctx, w, "claim key", err)
		case claim.State == ClaimBusy:
			return m.inProgress(w)
		case claim.State == ClaimStored:
			return m.replayStored(w, claim.Stored, fp)
		default:
			return m.unavailable(ctx, w, "claim key", fmt.Errorf("the store returned an unknown claim state %d", claim.State))
		}
	}
	lease := claim.Lease
	defer lease.Release(ctx) // runs on panics too; a no-op after Record

	rec := newRecorder(m.cfg.MaxResponseBytes)
	hctx := lease.Context(context.WithValue(ctx, ctxKey{}, &request{scope: scope, key: key}))
	r = r.WithContext(hctx)
	body.lend(r) // the handler reads the body again; its buffer is the handler's from now on
	next.ServeHTTP(rec, r)
	rec.finish()

	switch {
	case rec.err != nil:
		lease.Release(ctx)
		m.cfg.Logger.ErrorContext(ctx, "oncely idempotency: handler response not recorded", "err", rec.err, "limit", m.cfg.MaxResponseBytes)
		problem(w, http.StatusInternalServerError, "the response could not be recorded; the request had no effect")
		return result{outcome: OutcomeFailed, status: http.StatusInternalServerError, err: rec.err}
	case !m.cfg.StoreStatus(rec.status):
		lease.Release(ctx)
		rec.writeTo(w)
		return result{outcome: OutcomeNotStored, status: rec.status}
	case lease.Failed():
		// A statement of the handler failed and the handler answered
		// anyway: nothing of the transaction can commit. A refusal
		// (4xx) is passed through unrecorded; a success would be a lie.
		lease.Release(ctx)
		if rec.status >= 400 {
			rec.writeTo(w)
			return result{outcome: OutcomeNotStored, status: rec.status}
		}
		m.cfg.Logger.ErrorContext(ctx, "oncely idempotency: handler answered success but its transaction failed", "status", rec.status)
		problem(w, http.StatusInternalServerError, "the request's transaction failed; the request had no effect")
		return result{outcome: OutcomeFailed, status: http.StatusInternalServerError,
			err: fmt.Errorf("the handler answered %d but its transaction failed", rec.status)}
	}

	// Recording and committing run even if the client has gone away: the
	// handler finished, and the client's retry will get the replay.
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), m.cfg.CommitTimeout)
	defer cancel()
	names, values := rec.selected(m.replay)
	resp := rec.body.Bytes()
	if resp == nil {
		resp = []byte{} // an empty body, not NULL
	}
	err = lease.Record(wctx, StoredResponse{Fingerprint: fp, Status: rec.status, Names: names, Values: values, Body: resp})
	if errors.Is(err, ErrLeaseLost) {
		m.cfg.Logger.ErrorContext(ctx, "oncely idempotency: response not recorded: the key was taken over", "err", err)
		w.Header().Set("Retry-After", m.retryAfter)
		problem(w, http.StatusConflict, "this request's hold on its "+m.cfg.Header+" expired and a newer request took it over; retry to get that request's response")
		return result{outcome: OutcomeConflict, status: http.StatusConflict, err: err}
	}
	if err != nil {
		// Not committed, or (a connection lost during COMMIT) unknown:
		// either way the retry gets a fresh run or the replay.
		return m.unavailable(ctx, w, "record response", err)
	}
	if h := m.hooks.afterCommit; h != nil && h(r) != nil {
		panic(http.ErrAbortHandler) // the simulated crash: no response at all
	}
	rec.writeTo(w)
	return result{outcome: OutcomeStored, status: rec.status}
}

// replayStored answers a request whose key holds a recorded response.
func (m *Middleware) replayStored(w http.ResponseWriter, stored StoredResponse, fp []byte) result {
	if !bytes.Equal(stored.Fingerprint, fp) {
		problem(w, http.StatusUnprocessableEntity, "this "+m.cfg.Header+" was already used for a different request (method, path, query or body differ)")
		return result{outcome: OutcomeMismatch, status: http.StatusUnprocessableEntity}
	}
	writeReplay(w, stored.Status, stored.Names, stored.Values, stored.Body)
	return result{outcome: OutcomeReplayed, status: stored.Status}
}

func (m *Middleware) inProgress(w http.ResponseWriter) result {
	w.Header().Set("Retry-After", m.retryAfter)
	problem(w, http.StatusConflict, "a request with this "+m.cfg.Header+" is being processed; retry later")
	return result{outcome: OutcomeConflict, status: http.StatusConflict}
}

func (m *Middleware) unavailable(ctx context.Context, w http.ResponseWriter, op string, err error) result {
	m.cfg.Logger.ErrorContext(ctx, "oncely idempotency: store failure", "op", op, "err", err)
	w.Header().Set("Retry-After", m.retryAfter)
	problem(w, http.StatusServiceUnavailable, "the request was not completed; it is safe to retry")
	return result{outcome: OutcomeUnavailable, status: http.StatusServiceUnavailable, err: fmt.Errorf("%s: %w", op, err)}
}

// validToken reports whether s is an RFC 9110 token (header names, methods).
func validToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case bytes.IndexByte([]byte("!#$%&'*+-.^_`|~"), c) >= 0:
		default:
			return false
		}
	}
	return true
}
