package idempotency

import (
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/oncely/oncely/internal/telemetry"
)

// Metric and span names of the Middleware.
const (
	// MetricRequests counts keyed requests (and keyless ones of
	// Config.Methods) by oncely.idempotency.outcome, one of the Outcome*
	// values, and for refusals oncely.idempotency.refusal.
	MetricRequests = "oncely.idempotency.requests"
	// MetricDuration is the time the middleware spent on a request,
	// handler included, by outcome (histogram, seconds).
	MetricDuration = "oncely.idempotency.duration"
	// SpanRequest is the INTERNAL span of one request of Config.Methods;
	// the handler runs under it, so its own spans are children of it.
	SpanRequest = "idempotency request"
)

// Outcomes of a request (attribute oncely.idempotency.outcome).
const (
	OutcomeStored      = "stored"      // the handler ran; its response was recorded and committed with its writes
	OutcomeNotStored   = "not_stored"  // the handler ran; its status is not stored (Config.StoreStatus): rolled back, passed through
	OutcomeReplayed    = "replayed"    // a recorded response was replayed; the handler did not run
	OutcomeConflict    = "conflict"    // another request holds the key: 409
	OutcomeMismatch    = "mismatch"    // the key was used for a different request: 422
	OutcomeRefused     = "refused"     // the request was refused before the key was claimed: 400, 401 or 413
	OutcomeFailed      = "failed"      // the handler's response could not be recorded, or Scope failed: 500
	OutcomeUnavailable = "unavailable" // the database failed: 503
	OutcomeNoKey       = "no_key"      // no key, under Handler: passed through
	OutcomeAborted     = "aborted"     // the handler panicked, or the response was aborted: no answer
)

// Reasons for a refusal (attribute oncely.idempotency.refusal).
const (
	RefusalMissingKey     = "missing_key"    // under Require
	RefusalNoClient       = "no_client"      // no client to scope the key to: 401
	RefusalInvalidKey     = "invalid_key"    // empty, too long, several values, bad characters
	RefusalBodyTooLarge   = "body_too_large" // over Config.MaxBodyBytes
	RefusalBodyUnreadable = "body_unreadable"
)

var (
	attrOutcome = attribute.Key("oncely.idempotency.outcome")
	attrRefusal = attribute.Key("oncely.idempotency.refusal")
)

// result is what became of a request.
type result struct {
	outcome, refusal string
	status           int   // 0 when the handler answered a keyless request
	err              error // a database or recording failure
}

func newInstruments(cfg *Config) (*telemetry.Requests, error) {
	rq, err := telemetry.NewRequests(cfg.TracerProvider, cfg.MeterProvider,
		MetricRequests, "Requests of the idempotency middleware, by outcome (stored, replayed, conflict, mismatch...).",
		MetricDuration, "Duration of requests through the idempotency middleware, handler included.")
	if err != nil {
		return nil, fmt.Errorf("idempotency: metrics: %w", err)
	}
	return rq, nil
}

// attributes returns the metric attributes of a request with method.
func (res result) attributes(method string) []attribute.KeyValue {
	attrs := []attribute.KeyValue{telemetry.HTTPRequestMethod.String(method), attrOutcome.String(res.outcome)}
	if res.refusal != "" {
		attrs = append(attrs, attrRefusal.String(res.refusal))
	}
	return attrs
}

// spanAttributes returns the attributes only the span carries.
func (res result) spanAttributes() []attribute.KeyValue {
	if res.status == 0 {
		return nil
	}
	return []attribute.KeyValue{telemetry.HTTPResponseStatusCode.Int(res.status)}
}

// outcomes lists every outcome, and refusals every refusal reason.
var (
	outcomes = []string{OutcomeStored, OutcomeNotStored, OutcomeReplayed, OutcomeConflict, OutcomeMismatch,
		OutcomeRefused, OutcomeFailed, OutcomeUnavailable, OutcomeNoKey, OutcomeAborted}
	refusals = []string{RefusalMissingKey, RefusalNoClient, RefusalInvalidKey, RefusalBodyTooLarge, RefusalBodyUnreadable}
)

// methodTel is the telemetry of the requests of one method, built when the
// Middleware is: the span's start options and the Measure of each outcome,
// so that instrumenting a request allocates nothing but the span.
type methodTel struct {
	method   string
	spanOpts []trace.SpanStartOption
	measures map[outcomeKey]*telemetry.Measure // read-only once built
}

type outcomeKey struct{ outcome, refusal string }

func newMethodTel(tel *telemetry.Requests, method string) *methodTel {
	mt := &methodTel{
		method:   method,
		spanOpts: telemetry.SpanOptions(telemetry.HTTPRequestMethod.String(method)),
		measures: make(map[outcomeKey]*telemetry.Measure, len(outcomes)+len(refusals)),
	}
	for _, o := range outcomes {
		res := result{outcome: o}
		mt.measures[outcomeKey{o, ""}] = tel.Measure(res.attributes(method)...)
	}
	for _, reason := range refusals {
		res := result{outcome: OutcomeRefused, refusal: reason}
		mt.measures[outcomeKey{OutcomeRefused, reason}] = tel.Measure(res.attributes(method)...)
	}
	return mt
}

// measure returns the Measure of res.
func (mt *methodTel) measure(tel *telemetry.Requests, res result) *telemetry.Measure {
	if m, ok := mt.measures[outcomeKey{res.outcome, res.refusal}]; ok {
		return m
	}
	return tel.Measure(res.attributes(mt.method)...)
}
