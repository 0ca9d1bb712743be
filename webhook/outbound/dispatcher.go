package outbound

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/oncely/oncely/internal/backoff"
	"github.com/oncely/oncely/internal/telemetry"
)

// Dispatcher delivers due deliveries: it claims them from Postgres, POSTs
// them to their endpoints and records the outcome. Any number of
// dispatchers, in one process or many, may run over the same tables.
type Dispatcher struct {
	cfg     DispatcherConfig
	store   *Store
	backoff backoff.Policy
	client  *http.Client
	tr      *http.Transport
	q       dispatcherQueries
	metrics *metrics
	tracer  trace.Tracer
	started atomic.Bool
	stats   struct {
		claimed, delivered, retried, dead, interrupted, leasesLost, reaped, refused atomic.Int64
	}
	hooks *testHooks // set by this package's tests only
}

// testHooks are crash points for the package's own tests.
type testHooks struct {
	// abandon, when it returns true after an attempt's request ended,
	// makes the worker drop the attempt without recording anything, as if
	// its process had died there.
	abandon func(webhookID string, attempt int) bool
	// decided sees every decision before it is recorded.
	decided func(webhookID string, attempt int, dec decision)
}

type dispatcherQueries struct {
	lockEndpoints, claim, reap, record, ensureBreaker, lockBreaker, updateBreaker, depth, breakers string
}

// Stats are a dispatcher's counters since it was created.
type Stats struct {
	Claimed     int64 // attempts claimed
	Delivered   int64 // attempts answered 2xx
	Retried     int64 // failed attempts rescheduled
	Dead        int64 // deliveries that became dead here (terminal answer, refused address, attempts exhausted)
	Refused     int64 // attempts refused before any connection (forbidden address or scheme)
	Interrupted int64 // attempts cut short by shutdown, rescheduled at once
	LeasesLost  int64 // outcomes not recorded because the lease had expired and was taken over
	Reaped      int64 // expired leases of lost workers this dispatcher made due again
}

// NewDispatcher validates cfg and returns a Dispatcher.
func NewDispatcher(cfg DispatcherConfig) (*Dispatcher, error) {
	store, err := NewStore(cfg.Store)
	if err != nil {
		return nil, err
	}
	cfg, err = cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	m, err := newMetrics(cfg.MeterProvider)
	if err != nil {
		return nil, err
	}
	g := guard{allow: cfg.AllowNetworks}
	dialer := &net.Dialer{Timeout: cfg.RequestTimeout, KeepAlive: 30 * time.Second, Control: g.control}
	tr := &http.Transport{
		Proxy:                  nil, // a proxy would dial the endpoint itself, past the address check
		DialContext:            dialer.DialContext,
		ForceAttemptHTTP2:      true,
		MaxIdleConns:           100,
		MaxIdleConnsPerHost:    cfg.MaxInFlightPerEndpoint,
		IdleConnTimeout:        90 * time.Second,
		TLSHandshakeTimeout:    10 * time.Second,
		ExpectContinueTimeout:  time.Second,
		MaxResponseHeaderBytes: 64 << 10,
		DisableCompression:     true,
	}
	if cfg.TLSClientConfig != nil {
		tr.TLSClientConfig = cfg.TLSClientConfig.Clone()
	}
	client := &http.Client{
		Transport: tr,
		// Redirects are not followed: a 3xx is a failed attempt.
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
	s, d, b := store.subs, store.dels, store.brks
	// The per-endpoint slots: the cap while closed; one probe once an open
	// breaker's cool-down has passed and no probe is in flight; none while
	// throttled by a Retry-After.
	slots := `CASE WHEN b.throttled_until > now() THEN 0
			WHEN coalesce(b.state, 'closed') = 'closed' THEN $2
			WHEN b.open_until <= now() AND (b.probe_expires_at IS NULL OR b.probe_expires_at <= now()) THEN 1
			ELSE 0 END
		- (SELECT count(*) FROM ` + d + ` f WHERE f.subscription_id = s.id AND f.status = 'delivering' AND f.lease_expires_at > now())`
	return &Dispatcher{
		cfg: cfg, store: store, metrics: m, tracer: telemetry.Tracer(cfg.TracerProvider),
		backoff: backoff.Policy{Base: cfg.RetryBaseDelay, Max: cfg.RetryMaxDelay},
		client:  client, tr: tr,
		q: dispatcherQueries{
			// Step 1 of a claim: lock the subscriptions (endpoints) that have
			// due work and free slots, oldest due work first. The row lock
			// serializes claimers per endpoint; SKIP LOCKED sends a second
			// claimer to other endpoints instead of waiting. FOR NO KEY
			// UPDATE does not conflict with the KEY SHARE lock that Enqueue's
			// foreign key check takes, so open business transactions never
			// hold claims up.
			lockEndpoints: `SELECT s.id FROM ` + s + ` s
				CROSS JOIN LATERAL (SELECT d.next_attempt_at FROM ` + d + ` d
					WHERE d.subscription_id = s.id AND d.status = 'pending'
					ORDER BY d.next_attempt_at LIMIT 1) due
				LEFT JOIN ` + b + ` b ON b.subscription_id = s.id
				WHERE s.enabled AND s.paused_at IS NULL AND due.next_attempt_at <= now()
				  AND (` + slots + `) > 0
				ORDER BY due.next_attempt_at
				LIMIT $1
				FOR NO KEY UPDATE OF s SKIP LOCKED`,
			// Step 2, in a new statement and so a new snapshot taken after the
			// locks were granted: it sees every claim committed by the
			// previous holder of each lock, so the per-endpoint cap and the
			// single probe hold exactly. Each claimed attempt is counted and
			// gets a lease; a probe also takes the breaker's probe lease.
			claim: `WITH st AS (
					SELECT s.id AS sid, coalesce(b.state, 'closed') <> 'closed' AS probe, ` + slots + ` AS n
					FROM ` + s + ` s LEFT JOIN ` + b + ` b ON b.subscription_id = s.id
					WHERE s.id = ANY ($1) AND s.enabled AND s.paused_at IS NULL
				), picked AS (
					SELECT p.id, p.next_attempt_at, st.probe FROM st CROSS JOIN LATERAL (
						SELECT d.id, d.next_attempt_at FROM ` + d + ` d
						WHERE d.subscription_id = st.sid AND d.status = 'pending' AND d.next_attempt_at <= now()
						ORDER BY d.next_attempt_at, d.id LIMIT greatest(st.n, 0)
						FOR UPDATE SKIP LOCKED) p
					ORDER BY p.next_attempt_at, p.id LIMIT $3
				), claimed AS (
					UPDATE ` + d + ` d SET status = 'delivering', attempts = d.attempts + 1,
						lease_token = gen_random_uuid(), lease_holder = $5,
						lease_expires_at = now() + make_interval(secs => $4), updated_at = now()
					FROM picked WHERE d.id = picked.id
					RETURNING d.id, d.subscription_id, d.webhook_id, d.event_id, d.event_type, d.payload,
						d.attempts, d.lease_token, d.lease_expires_at, picked.probe
				), probe AS (
					INSERT INTO ` + b + ` (subscription_id, state, probe_token, probe_expires_at, updated_at)
					SELECT subscription_id, 'half_open', lease_token, lease_expires_at, now() FROM claimed WHERE probe
					ON CONFLICT (subscription_id) DO UPDATE SET state = 'half_open', probe_token = EXCLUDED.probe_token,
						probe_expires_at = EXCLUDED.probe_expires_at, updated_at = now()
				)
				SELECT c.id, c.subscription_id, s.endpoint_url, s.secrets, c.webhook_id, c.event_id, c.event_type,
					c.payload, c.attempts, c.lease_token, c.probe
				FROM claimed c JOIN ` + s + ` s ON s.id = c.subscription_id`,
			// A lease that expired belongs to a worker that is gone: the
			// attempt counts (the receiver may have got it), the delivery is
			// due again at once, or dead if that was its last attempt.
			reap: `UPDATE ` + d + ` d SET
					status = CASE WHEN d.attempts >= $1 THEN 'dead' ELSE 'pending' END,
					next_attempt_at = now(), last_status = NULL,
					last_error = 'attempt ' || d.attempts || ': the lease of ' || coalesce(d.lease_holder, 'its worker') ||
						' expired before an outcome was recorded (worker lost)',
					dead_at = CASE WHEN d.attempts >= $1 THEN now() END,
					lease_token = NULL, lease_holder = NULL, lease_expires_at = NULL, updated_at = now()
				WHERE d.id IN (SELECT id FROM ` + d + ` WHERE status = 'delivering' AND lease_expires_at <= now()
					ORDER BY lease_expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)
				RETURNING d.subscription_id, d.webhook_id, d.attempts, d.status`,
			// The lease token fences the outcome: a worker whose lease expired
			// and was reaped or taken over changes nothing.
			record: `UPDATE ` + d + ` SET status = $3,
					next_attempt_at = CASE WHEN $3 = 'pending' THEN now() + make_interval(secs => $4) ELSE next_attempt_at END,
					last_status = $5, last_error = $6,
					delivered_at = CASE WHEN $3 = 'delivered' THEN now() END,
					dead_at = CASE WHEN $3 = 'dead' THEN now() END,
					lease_token = NULL, lease_holder = NULL, lease_expires_at = NULL, updated_at = now()
				WHERE id = $1 AND lease_token = $2 AND status = 'delivering'`,
			ensureBreaker: `INSERT INTO ` + b + ` (subscription_id) VALUES ($1) ON CONFLICT DO NOTHING`,
			lockBreaker:   `SELECT ` + breakerCols + `, now() FROM ` + b + ` WHERE subscription_id = $1 FOR UPDATE`,
			updateBreaker: `UPDATE ` + b + ` SET state = $2, consecutive_failures = $3, failing_since = $4, opened_at = $5,
					open_until = $6, probe_token = $7, probe_expires_at = $8, throttled_until = $9, updated_at = now()
				WHERE subscription_id = $1`,
			depth: `SELECT subscription_id, status, count(*) FROM ` + d + `
				WHERE status IN ('pending', 'delivering') GROUP BY 1, 2`,
			breakers: `SELECT s.id, coalesce(b.state, 'closed') FROM ` + s + ` s LEFT JOIN ` + b + ` b ON b.subscription_id = s.id`,
		},
	}, nil
}

// Stats returns the dispatcher's counters.
func (d *Dispatcher) Stats() Stats {
	return Stats{
		Claimed: d.stats.claimed.Load(), Delivered: d.stats.delivered.Load(), Retried: d.stats.retried.Load(),
		Dead: d.stats.dead.Load(), Refused: d.stats.refused.Load(), Interrupted: d.stats.interrupted.Load(),
		LeasesLost: d.stats.leasesLost.Load(), Reaped: d.stats.reaped.Load(),
	}
}

// job is one claimed attempt.
type job struct {
	id        int64
	sub       uuid.UUID
	url       string
	secrets   []string
	webhookID string
	eventID   string
	eventType string
	payload   []byte
	attempt   int
	token     uuid.UUID
	probe     bool
	deadline  time.Time // local clock: claim start + RequestTimeout, before the lease expires
	subAttr   string    // metric attribute value (subscription id)
}

// Run delivers until ctx is done, then stops claiming, lets the attempts in
// flight finish (cancelling them after DrainTimeout) and returns nil. It may
// be called once.
func (d *Dispatcher) Run(ctx context.Context) error {
	if !d.started.CompareAndSwap(false, true) {
		return errors.New("outbound: Dispatcher.Run called more than once")
	}
	defer d.tr.CloseIdleConnections()
	if reg, err := d.metrics.observe(d); err == nil {
		defer func() { _ = reg.Unregister() }()
	} else {
		d.cfg.Logger.Warn("oncely webhooks: metrics callback not registered", "err", err)
	}
	// Attempts outlive ctx by up to DrainTimeout; outcomes are always
	// recorded (with their own timeout) unless the process dies.
	workCtx, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	jobs := make(chan *job, d.cfg.Workers) // never more than Workers outstanding: sends never block
	done := make(chan struct{}, d.cfg.Workers)
	var workers sync.WaitGroup
	for range d.cfg.Workers {
		workers.Go(func() {
			for j := range jobs {
				d.attempt(workCtx, j)
				done <- struct{}{}
			}
		})
	}
	var bg sync.WaitGroup
	bgCtx, stopBG := context.WithCancel(ctx)
	if d.cfg.Retention > 0 {
		bg.Go(func() { d.cleanup(bgCtx) })
	}
	d.cfg.Logger.Info("oncely webhooks dispatcher started", "id", d.cfg.ID, "schema", d.store.schema, "workers", d.cfg.Workers)

	d.loop(ctx, jobs, done)

	close(jobs)
	stopBG()
	bg.Wait()
	drained := make(chan struct{})
	go func() { workers.Wait(); close(drained) }()
	t := time.NewTimer(d.cfg.DrainTimeout)
	defer t.Stop()
	select {
	case <-drained:
	case <-t.C:
		d.cfg.Logger.Warn("oncely webhooks: drain timeout passed; cancelling attempts in flight", "drain_timeout", d.cfg.DrainTimeout)
		cancelWork()
		<-drained
	}
	d.cfg.Logger.Info("oncely webhooks dispatcher stopped", "id", d.cfg.ID)
	return nil
}

// loop claims as many attempts as there are idle workers, whenever a worker
// frees up or every PollInterval, until ctx is done.
func (d *Dispatcher) loop(ctx context.Context, jobs chan<- *job, done <-chan struct{}) {
	free := d.cfg.Workers
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	var lastReap time.Time
	errs := 0
	for {
		for more := true; more; { // collect finished attempts
			select {
			case <-done:
				free++
			default:
				more = false
			}
		}
		if ctx.Err() != nil {
			return
		}
		if time.Since(lastReap) >= d.cfg.PollInterval {
			d.reap(ctx)
			lastReap = time.Now()
		}
		wait := d.cfg.PollInterval
		if free > 0 {
			js, err := d.claim(ctx, free)
			switch {
			case err != nil && ctx.Err() != nil:
				return
			case err != nil:
				errs++
				wait = max(d.backoff.Delay(errs), 10*time.Millisecond)
				wait = min(wait, 10*d.cfg.PollInterval)
				d.cfg.Logger.Warn("oncely webhooks: claim failed", "err", err, "retry_in", wait)
			default:
				errs = 0
				for _, j := range js {
					jobs <- j
				}
				free -= len(js)
				if len(js) > 0 && free > 0 {
					continue // more may be due
				}
			}
		}
		timer.Reset(wait)
		select {
		case <-ctx.Done():
			return
		case <-done:
			free++
		case <-timer.C:
		}
		timer.Stop()
	}
}

// claim claims up to n due attempts in one short transaction. Once started,
// a claim is not cut short by ctx (a claim committed but not handed to a
// worker would spend an attempt without a request); it is bounded by its own
// timeout instead.
func (d *Dispatcher) claim(ctx context.Context, n int) ([]*job, error) {
	deadline := time.Now().Add(d.cfg.RequestTimeout) // taken before the lease starts
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), claimTimeout)
	defer cancel()
	tx, err := d.cfg.Pool.Begin(ctx)
	if err != nil {
		return nil, err
	}
	defer rollback(ctx, tx)
	rows, err := tx.Query(ctx, d.q.lockEndpoints, n, d.cfg.MaxInFlightPerEndpoint)
	if err != nil {
		return nil, fmt.Errorf("lock endpoints: %w", err)
	}
	subs, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil || len(subs) == 0 {
		return nil, err
	}
	rows, err = tx.Query(ctx, d.q.claim, subs, d.cfg.MaxInFlightPerEndpoint, n, d.cfg.LeaseDuration.Seconds(), d.cfg.ID)
	if err != nil {
		return nil, fmt.Errorf("claim: %w", err)
	}
	js, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (*job, error) {
		j := &job{deadline: deadline}
		var attempt int32
		err := r.Scan(&j.id, &j.sub, &j.url, &j.secrets, &j.webhookID, &j.eventID, &j.eventType, &j.payload, &attempt, &j.token, &j.probe)
		j.attempt, j.subAttr = int(attempt), j.sub.String()
		return j, err
	})
	if err != nil {
		return nil, fmt.Errorf("claim: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("claim: commit: %w", err)
	}
	d.stats.claimed.Add(int64(len(js)))
	return js, nil
}

// claimTimeout bounds one claim transaction.
const claimTimeout = 10 * time.Second

func rollback(ctx context.Context, tx pgx.Tx) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_ = tx.Rollback(rctx)
}

// reap makes the deliveries of lost workers due again.
func (d *Dispatcher) reap(ctx context.Context) {
	rows, err := d.cfg.Pool.Query(ctx, d.q.reap, d.cfg.MaxAttempts, 100)
	if err != nil {
		if ctx.Err() == nil {
			d.cfg.Logger.Warn("oncely webhooks: reaping expired leases failed", "err", err)
		}
		return
	}
	var (
		sub              uuid.UUID
		webhookID, state string
		attempts         int32
	)
	_, err = pgx.ForEachRow(rows, []any{&sub, &webhookID, &attempts, &state}, func() error {
		d.stats.reaped.Add(1)
		d.cfg.Logger.Warn("oncely webhooks: lease expired; the worker was lost", "webhook_id", webhookID,
			"subscription", sub, "attempt", attempts, "now", state)
		if state == string(StatusDead) {
			d.stats.dead.Add(1)
			d.metrics.dead.Add(ctx, 1, d.metrics.attrs(sub.String()))
		}
		return nil
	})
	if err != nil && ctx.Err() == nil {
		d.cfg.Logger.Warn("oncely webhooks: reaping expired leases failed", "err", err)
	}
}

// result is what one request produced.
type result struct {
	status     int // 0: no response
	retryAfter string
	body       []byte
	err        error
	duration   time.Duration
}

// decision is what becomes of the delivery after an attempt.
type decision struct {
	status      DeliveryStatus // delivered, pending (retry) or dead
	delay       time.Duration  // before the retry
	kind        outcomeKind    // for the breaker
	retryAfter  time.Duration  // honoured Retry-After, throttling the endpoint
	lastStatus  int
	lastError   string
	refused     bool          // no connection was made
	interrupted bool          // cut short by shutdown
	duration    time.Duration // of the request, when one was made
}

// attempt sends one claimed attempt and records its outcome.
func (d *Dispatcher) attempt(workCtx context.Context, j *job) {
	rctx, cancel := context.WithDeadline(workCtx, j.deadline)
	res := d.send(rctx, j)
	cancel()
	if h := d.hooks; h != nil && h.abandon != nil && h.abandon(j.webhookID, j.attempt) {
		return // a simulated crash: nothing recorded, the lease will expire
	}
	dec := d.decide(j, res, workCtx.Err() != nil, time.Now())
	dec.duration = res.duration
	if h := d.hooks; h != nil && h.decided != nil {
		h.decided(j.webhookID, j.attempt, dec)
	}
	// Record even while shutting down; bounded on its own.
	ctx, cancelRec := context.WithTimeout(context.WithoutCancel(workCtx), 10*time.Second)
	defer cancelRec()
	if err := d.record(ctx, j, dec); err != nil {
		d.cfg.Logger.Error("oncely webhooks: recording an outcome failed; the attempt will be retried after its lease expires",
			"webhook_id", j.webhookID, "attempt", j.attempt, "err", err)
	}
}

// send makes the HTTP request of one attempt.
func (d *Dispatcher) send(ctx context.Context, j *job) (res result) {
	if err := ValidateURL(j.url); err != nil {
		return result{err: &configError{err}} // changed since it was stored: never worth a retry
	}
	keys, err := decodeSecrets(j.secrets)
	if err != nil {
		return result{err: &configError{fmt.Errorf("subscription secrets: %w", err)}}
	}
	host := ""
	if u, err := url.Parse(j.url); err == nil {
		host = u.Hostname()
	}
	ctx, span := d.tracer.Start(ctx, "POST", trace.WithSpanKind(trace.SpanKindClient), trace.WithAttributes(
		attrHTTPMethod.String(http.MethodPost), attrServerAddress.String(host),
		attrSubscription.String(j.subAttr), telemetry.Attempt.Int(j.attempt),
		attrResendCount.Int(j.attempt-1), attrWebhookID.String(j.webhookID)))
	defer func() {
		if res.status != 0 {
			span.SetAttributes(attrHTTPStatus.Int(res.status))
		}
		if res.err != nil {
			telemetry.Fail(span, res.err, errorType(res.err))
		} else if res.status >= 400 {
			telemetry.Fail(span, fmt.Errorf("HTTP %d", res.status), strconv.Itoa(res.status))
		}
		span.End()
	}()

	ts := strconv.FormatInt(time.Now().Unix(), 10)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, j.url, bytes.NewReader(j.payload))
	if err != nil {
		return result{err: &configError{err}}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", d.cfg.UserAgent)
	req.Header.Set(HeaderID, j.webhookID)
	req.Header.Set(HeaderTimestamp, ts)
	req.Header.Set(HeaderSignature, sign(keys, j.webhookID, ts, j.payload))
	req.Header.Set(HeaderAttempt, strconv.Itoa(j.attempt))
	req.Header.Set(HeaderEventType, j.eventType)
	start := time.Now()
	resp, err := d.client.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			ue.URL = RedactURL(j.url) // net/http hides the password only
		}
		return result{err: err, duration: time.Since(start)}
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, d.cfg.MaxResponseBytes)) // the status decides; the body is only quoted
	return result{status: resp.StatusCode, retryAfter: resp.Header.Get("Retry-After"), body: body, duration: time.Since(start)}
}

// configError is a delivery that cannot be attempted as configured.
type configError struct{ err error }

func (e *configError) Error() string { return e.err.Error() }
func (e *configError) Unwrap() error { return e.err }

func errorType(err error) string {
	var ae *AddressError
	var he *HostError
	var ce *configError
	switch {
	case errors.As(err, &ae), errors.As(err, &he):
		return "address_refused"
	case errors.As(err, &ce), errors.Is(err, ErrScheme):
		return "config"
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, context.Canceled):
		return "canceled"
	}
	return "network"
}

// Retryable reports whether an HTTP status asks for a retry: 408, 425, 429,
// 5xx, and 3xx (redirects are not followed). 2xx is success; every other
// status is terminal.
func Retryable(status int) bool {
	switch {
	case status == http.StatusRequestTimeout, status == http.StatusTooEarly, status == http.StatusTooManyRequests:
		return true
	case status >= 500, status >= 300 && status < 400:
		return true
	}
	return false
}

// decide turns an attempt's result into the delivery's next state.
// interrupted: the dispatcher is shutting down and cancelled the request.
func (d *Dispatcher) decide(j *job, res result, interrupted bool, now time.Time) decision {
	switch {
	case res.err != nil:
		var ae *AddressError
		var ce *configError
		if errors.As(res.err, &ae) || errors.As(res.err, &ce) || errors.Is(res.err, ErrScheme) {
			return decision{status: StatusDead, kind: neutral, refused: true,
				lastError: truncateErr(fmt.Sprintf("attempt %d: refused: %v", j.attempt, res.err))}
		}
		if interrupted {
			return decision{status: StatusPending, kind: neutral, interrupted: true,
				lastError: truncateErr(fmt.Sprintf("attempt %d: interrupted by dispatcher shutdown: %v", j.attempt, res.err))}
		}
		return d.retry(j, decision{kind: failure, lastError: fmt.Sprintf("attempt %d: %v", j.attempt, res.err)}, 0)
	case res.status >= 200 && res.status < 300:
		return decision{status: StatusDelivered, kind: success, lastStatus: res.status}
	case Retryable(res.status):
		ra, _ := parseRetryAfter(res.retryAfter, now)
		ra = min(ra, d.cfg.MaxRetryAfter)
		return d.retry(j, decision{kind: failure, lastStatus: res.status,
			lastError: fmt.Sprintf("attempt %d: HTTP %d%s", j.attempt, res.status, quoteBody(res.body))}, ra)
	default:
		return decision{status: StatusDead, kind: neutral, lastStatus: res.status,
			lastError: truncateErr(fmt.Sprintf("attempt %d: HTTP %d (terminal)%s", j.attempt, res.status, quoteBody(res.body)))}
	}
}

// retry schedules the next attempt, or declares the delivery dead after the
// last one. A Retry-After (already capped) replaces the backoff delay.
func (d *Dispatcher) retry(j *job, dec decision, retryAfter time.Duration) decision {
	if j.attempt >= d.cfg.MaxAttempts {
		dec.status = StatusDead
		dec.lastError += fmt.Sprintf(" (attempts exhausted: %d of %d)", j.attempt, d.cfg.MaxAttempts)
	} else {
		dec.status = StatusPending
		dec.delay = d.backoff.Delay(j.attempt)
		if retryAfter > 0 {
			dec.delay, dec.retryAfter = retryAfter, retryAfter
		}
	}
	dec.lastError = truncateErr(dec.lastError)
	return dec
}

// parseRetryAfter reads a Retry-After header: delay-seconds or an HTTP date
// (relative to now; a date in the past means no wait).
func parseRetryAfter(h string, now time.Time) (time.Duration, bool) {
	h = strings.TrimSpace(h)
	if h == "" {
		return 0, false
	}
	if n, err := strconv.ParseUint(h, 10, 64); err == nil {
		if n > uint64(365*24*time.Hour/time.Second) {
			n = uint64(365 * 24 * time.Hour / time.Second) // the caller caps it further
		}
		return time.Duration(n) * time.Second, true
	}
	if t, err := http.ParseTime(h); err == nil {
		return max(t.Sub(now), 0), true
	}
	return 0, false
}

const maxErrLen = 1024

func truncateErr(s string) string {
	if len(s) <= maxErrLen {
		return s
	}
	s = s[:maxErrLen]
	for !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s + "..."
}

// quoteBody renders the start of a response body for last_error.
func quoteBody(b []byte) string {
	const n = 200
	if len(b) == 0 {
		return ""
	}
	if len(b) > n {
		b = b[:n]
	}
	s := strings.ToValidUTF8(string(b), "?")
	return ": " + strconv.Quote(s)
}

// record stores an attempt's outcome and updates the endpoint's breaker, in
// one transaction fenced by the lease token; then pauses the subscription if
// the breaker says so.
func (d *Dispatcher) record(ctx context.Context, j *job, dec decision) error {
	tx, err := d.cfg.Pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer rollback(ctx, tx)
	var lastStatus, lastError any
	if dec.lastStatus != 0 {
		lastStatus = dec.lastStatus
	}
	if dec.lastError != "" {
		lastError = dec.lastError
	}
	tag, err := tx.Exec(ctx, d.q.record, j.id, j.token, string(dec.status), dec.delay.Seconds(), lastStatus, lastError)
	if err != nil {
		return fmt.Errorf("record: %w", err)
	}
	if tag.RowsAffected() == 0 {
		d.stats.leasesLost.Add(1)
		d.cfg.Logger.Warn("oncely webhooks: lease lost before the outcome was recorded; another attempt follows",
			"webhook_id", j.webhookID, "attempt", j.attempt, "outcome", dec.status)
		return nil
	}
	var (
		pause  bool
		before Breaker
		after  Breaker
	)
	if dec.kind != neutral || j.probe {
		if _, err := tx.Exec(ctx, d.q.ensureBreaker, j.sub); err != nil {
			return fmt.Errorf("breaker: %w", err)
		}
		var now time.Time
		row := tx.QueryRow(ctx, d.q.lockBreaker, j.sub)
		before, err = scanBreakerNow(row, &now)
		if err != nil {
			return fmt.Errorf("breaker: %w", err)
		}
		after, pause = d.cfg.Breaker.transition(before, dec.kind, before.ProbeToken == j.token, dec.retryAfter, now)
		if after != before {
			_, err := tx.Exec(ctx, d.q.updateBreaker, j.sub, string(after.State), after.ConsecutiveFailures,
				nullTime(after.FailingSince), nullTime(after.OpenedAt), nullTime(after.OpenUntil),
				nullUUID(after.ProbeToken), nullTime(after.ProbeExpiresAt), nullTime(after.ThrottledUntil))
			if err != nil {
				return fmt.Errorf("breaker: %w", err)
			}
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("record: commit: %w", err)
	}

	attrs := d.metrics.attrs(j.subAttr)
	if !dec.refused {
		d.metrics.recordDuration(ctx, j.subAttr, dec)
	}
	switch dec.status {
	case StatusDelivered:
		d.stats.delivered.Add(1)
		d.metrics.delivered.Add(ctx, 1, attrs)
	case StatusPending:
		if dec.interrupted {
			d.stats.interrupted.Add(1)
		} else {
			d.stats.retried.Add(1)
			d.metrics.retried.Add(ctx, 1, attrs)
		}
	case StatusDead:
		d.stats.dead.Add(1)
		d.metrics.dead.Add(ctx, 1, attrs)
		if dec.refused {
			d.stats.refused.Add(1)
		}
	}
	log := d.cfg.Logger.With("webhook_id", j.webhookID, "subscription", j.sub, "attempt", j.attempt)
	switch dec.status {
	case StatusDelivered:
		log.Debug("oncely webhooks: delivered", "status", dec.lastStatus)
	case StatusPending:
		log.Info("oncely webhooks: attempt failed; retrying", "err", dec.lastError, "retry_in", dec.delay)
	case StatusDead:
		log.Warn("oncely webhooks: delivery dead", "err", dec.lastError)
	}
	if before.State != after.State && after.State != "" {
		log.Info("oncely webhooks: breaker "+string(after.State), "from", before.State,
			"consecutive_failures", after.ConsecutiveFailures, "open_until", after.OpenUntil)
	}
	if pause {
		reason := fmt.Sprintf("paused automatically: the endpoint has been failing since %s (%d consecutive failures); last: %s",
			after.FailingSince.UTC().Format(time.RFC3339), after.ConsecutiveFailures, dec.lastError)
		if _, err := d.cfg.Pool.Exec(ctx, d.store.q.pause, j.sub, truncateErr(reason)); err != nil {
			return fmt.Errorf("pause subscription: %w", err)
		}
		log.Warn("oncely webhooks: subscription paused", "reason", reason)
	}
	return nil
}

func scanBreakerNow(row pgx.Row, now *time.Time) (Breaker, error) {
	return scanBreaker(rowWithExtra{row, now})
}

// rowWithExtra scans a breaker row followed by one more column.
type rowWithExtra struct {
	pgx.Row
	extra any
}

func (r rowWithExtra) Scan(dest ...any) error { return r.Row.Scan(append(dest, r.extra)...) }

// cleanup deletes delivered rows past the retention every CleanupInterval.
func (d *Dispatcher) cleanup(ctx context.Context) {
	t := time.NewTicker(d.cfg.CleanupInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if _, err := d.store.DeleteDelivered(ctx, d.cfg.Pool, d.cfg.Retention, d.cfg.CleanupBatch); err != nil && ctx.Err() == nil {
			d.cfg.Logger.Warn("oncely webhooks: retention cleanup failed", "err", err)
		}
	}
}

func randomSuffix() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
