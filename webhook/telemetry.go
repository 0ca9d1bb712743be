package webhook

import (
	"errors"
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/oncely/oncely/internal/telemetry"
)

// Metric and span names of the Receiver and the Intake.
const (
	// MetricInboundRequests counts requests by oncely.webhook.outcome
	// (accepted, duplicate, refused, failed; an Intake's also in_progress)
	// and, for refusals,
	// oncely.webhook.refusal (one of the Refusal* values).
	MetricInboundRequests = "oncely.webhook.inbound.requests"
	// MetricInboundDuration is the time from the request's arrival to its
	// answer, by outcome (histogram, seconds).
	MetricInboundDuration = "oncely.webhook.inbound.duration"
	// SpanReceive is the INTERNAL span of one request, a child of the
	// server's span when the server is instrumented: the outbox row's trace
	// context, which the relay continues, is this span's.
	SpanReceive = "webhook receive"
)

// Outcomes of a request (attribute oncely.webhook.outcome).
const (
	OutcomeAccepted  = "accepted"  // stored, answered 202 (an Intake: the handler ran and answered below 500)
	OutcomeDuplicate = "duplicate" // already stored, answered 202 (an Intake: the handler's answer replayed)
	OutcomeRefused   = "refused"   // answered 4xx, nothing stored
	OutcomeFailed    = "failed"    // not stored, answered 503 (an Intake: the handler, or the store, answered 5xx)
)

// Reasons for a refusal (attribute oncely.webhook.refusal).
const (
	RefusalMethod            = "method"             // not a POST: 405
	RefusalBodyTooLarge      = "body_too_large"     // over MaxBodyBytes: 413
	RefusalBodyUnreadable    = "body_unreadable"    // the body could not be read: 400
	RefusalMissingSignature  = "missing_signature"  // ErrMissingSignature
	RefusalMalformedHeader   = "malformed_header"   // ErrMalformedHeader
	RefusalSignatureMismatch = "signature_mismatch" // ErrSignatureMismatch
	RefusalTimestamp         = "timestamp"          // ErrTimestamp
	RefusalNoDeliveryID      = "no_delivery_id"     // ErrNoDeliveryID, or a verifier returning no id
	RefusalDeliveryIDTooLong = "delivery_id_too_long"
	RefusalVerifier          = "verifier" // a verifier's own error
)

var (
	attrOutcome  = attribute.Key("oncely.webhook.outcome")
	attrRefusal  = attribute.Key("oncely.webhook.refusal")
	attrProvider = attribute.Key("oncely.webhook.provider")
)

// refusalOf names the reason of a verifier's error.
func refusalOf(err error) string {
	for _, r := range []struct {
		err    error
		reason string
	}{
		{ErrMissingSignature, RefusalMissingSignature}, {ErrMalformedHeader, RefusalMalformedHeader},
		{ErrSignatureMismatch, RefusalSignatureMismatch}, {ErrTimestamp, RefusalTimestamp},
		{ErrNoDeliveryID, RefusalNoDeliveryID},
	} {
		if errors.Is(err, r.err) {
			return r.reason
		}
	}
	return RefusalVerifier
}

// intake is what became of one request.
type intake struct {
	outcome, refusal string
	status           int
	delivery         Delivery // what the verifier returned, if it accepted the request
	messageID        string
	err              error
}

func newInstruments(tp trace.TracerProvider, mp metric.MeterProvider) (*telemetry.Requests, error) {
	rq, err := telemetry.NewRequests(tp, mp,
		MetricInboundRequests, "Inbound webhook requests, by outcome (accepted, duplicate, refused, failed) and refusal reason.",
		MetricInboundDuration, "Duration of inbound webhook requests, from arrival to answer, storing the delivery included.")
	if err != nil {
		return nil, fmt.Errorf("webhook: metrics: %w", err)
	}
	return rq, nil
}

// attributes returns the metric attributes of a request to topic (none for
// an Intake's), and the span's own.
func (it intake) attributes(topic string) (metricAttrs, spanAttrs []attribute.KeyValue) {
	metricAttrs = []attribute.KeyValue{attrOutcome.String(it.outcome)}
	if topic != "" {
		metricAttrs = append(metricAttrs, telemetry.MessagingDestination.String(topic))
	}
	if it.refusal != "" {
		metricAttrs = append(metricAttrs, attrRefusal.String(it.refusal))
	}
	if it.delivery.Provider != "" {
		metricAttrs = append(metricAttrs, attrProvider.String(it.delivery.Provider))
	}
	spanAttrs = []attribute.KeyValue{telemetry.HTTPResponseStatusCode.Int(it.status)}
	if it.messageID != "" {
		spanAttrs = append(spanAttrs, telemetry.MessagingMessageID.String(it.messageID))
	}
	// A refusal is the receiver doing its job, not an error of the span:
	// its outcome and refusal attributes say why. Only a failure to store
	// (it.err) marks the span failed.
	return metricAttrs, spanAttrs
}
