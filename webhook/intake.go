package webhook

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/oncely/oncely/idempotency"
	"github.com/oncely/oncely/internal/telemetry"
)

// OutcomeInProgress is an Intake's answer to a delivery whose id another
// request is processing right now: 409, and the provider retries.
const OutcomeInProgress = "in_progress"

// IntakeConfig configures an Intake.
type IntakeConfig struct {
	// Verifier authenticates requests. Required.
	Verifier Verifier
	// Idempotency runs Handler once per delivery: the delivery id is the
	// request's key, scoped to the provider (Delivery.Provider). Any store
	// serves; idempotency.NewWithStore with package
	// idempotency/redisstore's is the one for an intake without Postgres.
	// Leave its Config.Scope and GlobalScope unset. Required.
	Idempotency *idempotency.Middleware
	// Handler processes a delivery: the raw body is its request body, and
	// idempotency.Key(r.Context()) returns the provider and the delivery
	// id. A response it answers with a status below 500 is recorded and
	// replayed to every redelivery; a 5xx is not, so the provider's retry
	// runs it again. Required.
	Handler http.Handler
	// IDPrefix is put before the delivery id to form the key, as
	// Config.IDPrefix.
	IDPrefix string
	// MaxBodyBytes bounds the request body; a longer one is answered 413.
	// Default DefaultMaxBodyBytes (1 MiB).
	MaxBodyBytes int64
	// Logger receives a line per refusal. Default: discard.
	Logger *slog.Logger
	// TracerProvider and MeterProvider instrument the intake as a Receiver
	// (SpanReceive, MetricInboundRequests, MetricInboundDuration), without
	// a destination. Default: the global providers.
	TracerProvider trace.TracerProvider
	MeterProvider  metric.MeterProvider
}

// Intake is the http.Handler of a webhook endpoint whose processing is not
// a Postgres write, such as a call to another service: it verifies each
// request as a Receiver does, then runs the delivery through an
// Idempotency-Key middleware with the delivery id as the key. Where a
// Receiver stores the delivery in the outbox and answers 202, an Intake
// answers what the Handler answered, and a redelivery gets that answer
// replayed without the Handler running again. Requests that fail the
// verification are refused before anything is claimed in the store.
//
// The guarantee is the middleware's store's (see package idempotency and
// idempotency/redisstore): the Handler runs once per delivery id unless the
// process dies, or the store fails, after the Handler's effect and before
// its response is recorded; the Handler should therefore pass the delivery
// id on, as an idempotency key, to what it calls.
type Intake struct {
	cfg     IntakeConfig
	gate    gate
	next    http.Handler
	tel     *telemetry.Requests
	handled atomic.Int64
}

// NewIntake returns an Intake.
func NewIntake(cfg IntakeConfig) (*Intake, error) {
	switch {
	case cfg.Verifier == nil:
		return nil, errors.New("webhook: IntakeConfig.Verifier is required (NewStandardWebhooks, NewStripe, NewGitHub or your own)")
	case cfg.Idempotency == nil:
		return nil, errors.New("webhook: IntakeConfig.Idempotency is required (idempotency.New, or NewWithStore with a Redis store)")
	case cfg.Handler == nil:
		return nil, errors.New("webhook: IntakeConfig.Handler is required")
	case cfg.MaxBodyBytes < 0:
		return nil, fmt.Errorf("webhook: IntakeConfig.MaxBodyBytes: %d is negative", cfg.MaxBodyBytes)
	case len(cfg.IDPrefix) >= cfg.Idempotency.MaxKeyLength():
		return nil, fmt.Errorf("webhook: IntakeConfig.IDPrefix: %d bytes leave no room for an id within the middleware's MaxKeyLength (%d)", len(cfg.IDPrefix), cfg.Idempotency.MaxKeyLength())
	}
	cfg.MaxBodyBytes = cmp.Or(cfg.MaxBodyBytes, DefaultMaxBodyBytes)
	cfg.Logger = cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	tel, err := newInstruments(cfg.TracerProvider, cfg.MeterProvider)
	if err != nil {
		return nil, err
	}
	in := &Intake{cfg: cfg, next: cfg.Idempotency.Require(cfg.Handler), tel: tel}
	in.gate = gate{verifier: cfg.Verifier, idPrefix: cfg.IDPrefix, maxID: cfg.Idempotency.MaxKeyLength(), maxBody: cfg.MaxBodyBytes, logger: cfg.Logger}
	return in, nil
}

// IntakeStats are an Intake's counters since it was created.
type IntakeStats struct {
	Handled int64 // requests that passed the verification and went to the middleware
	Refused int64 // requests refused before it (405, 413, 401, 400 or a verifier's own status)
}

// Stats returns the counters.
func (in *Intake) Stats() IntakeStats {
	return IntakeStats{Handled: in.handled.Load(), Refused: in.gate.refused.Load()}
}

// ServeHTTP admits the request as Receiver.ServeHTTP does, then hands it,
// with the delivery id as its Idempotency-Key (replacing any the request
// carried) and the provider as its client, to the middleware and Handler.
func (in *Intake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	ctx, span := in.tel.Start(r.Context(), SpanReceive, telemetry.HTTPRequestMethod.String(r.Method))
	r = r.WithContext(ctx)
	it := in.serve(w, r)
	attrs, spanAttrs := it.attributes("")
	in.tel.End(ctx, span, start, attrs, spanAttrs, it.err, "handler")
}

func (in *Intake) serve(w http.ResponseWriter, r *http.Request) intake {
	d, body, id, refused := in.gate.admit(w, r)
	if refused != nil {
		return *refused
	}
	in.handled.Add(1)
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	r.Header.Set(in.cfg.Idempotency.Header(), id)
	sw := &statusWriter{ResponseWriter: w}
	in.next.ServeHTTP(sw, r.WithContext(idempotency.WithClient(r.Context(), d.Provider)))
	it := intake{outcome: OutcomeAccepted, status: cmp.Or(sw.status, http.StatusOK), delivery: d, messageID: id}
	switch {
	case w.Header().Get(idempotency.ReplayedHeader) == "true":
		it.outcome = OutcomeDuplicate
	case it.status == http.StatusConflict:
		it.outcome = OutcomeInProgress
	case it.status >= 500:
		it.outcome, it.err = OutcomeFailed, fmt.Errorf("webhook: delivery %q answered %d", id, it.status)
	}
	return it
}

// statusWriter remembers the status a handler answered.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(p)
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
