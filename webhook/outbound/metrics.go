package outbound

import (
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/oncely/oncely/internal/telemetry"
)

// Attribute keys of the dispatcher's metrics and spans.
const (
	attrSubscription  = attribute.Key("oncely.webhook.subscription.id")
	attrWebhookID     = attribute.Key("oncely.webhook.id")
	attrOutcome       = attribute.Key("oncely.webhook.outcome") // delivered | retry | dead | interrupted
	attrStatus        = attribute.Key("oncely.webhook.delivery.status")
	attrBreakerState  = attribute.Key("oncely.webhook.breaker.state")
	attrHTTPMethod    = attribute.Key("http.request.method")
	attrHTTPStatus    = attribute.Key("http.response.status_code")
	attrResendCount   = attribute.Key("http.request.resend_count")
	attrServerAddress = attribute.Key("server.address")
)

// Metric names. Every series carries oncely.webhook.subscription.id (one
// series per endpoint: mind the cardinality with very many subscriptions).
const (
	MetricDelivered    = "oncely.webhook.delivered"        // counter: attempts answered 2xx
	MetricRetried      = "oncely.webhook.retried"          // counter: failed attempts rescheduled
	MetricDead         = "oncely.webhook.dead"             // counter: deliveries that became dead
	MetricDuration     = "oncely.webhook.request.duration" // histogram (s): request latency per attempt, with outcome and status code
	MetricQueueDepth   = "oncely.webhook.queue.depth"      // gauge: pending and in-flight deliveries, by delivery status
	MetricBreakerState = "oncely.webhook.breaker.state"    // gauge: 0 closed, 1 half-open, 2 open (and the state as an attribute)
)

type metrics struct {
	delivered, retried, dead metric.Int64Counter
	duration                 metric.Float64Histogram
	depth, breaker           metric.Int64ObservableGauge
	meter                    metric.Meter
}

func newMetrics(mp metric.MeterProvider) (*metrics, error) {
	m := &metrics{meter: telemetry.Meter(mp)}
	var errs [6]error
	m.delivered, errs[0] = m.meter.Int64Counter(MetricDelivered, metric.WithUnit("{attempt}"),
		metric.WithDescription("Webhook attempts answered 2xx."))
	m.retried, errs[1] = m.meter.Int64Counter(MetricRetried, metric.WithUnit("{attempt}"),
		metric.WithDescription("Failed webhook attempts rescheduled for a retry."))
	m.dead, errs[2] = m.meter.Int64Counter(MetricDead, metric.WithUnit("{delivery}"),
		metric.WithDescription("Webhook deliveries that became dead (terminal answer, refused address, attempts exhausted)."))
	m.duration, errs[3] = telemetry.DurationHistogram(m.meter, MetricDuration, "Duration of webhook requests, per attempt.")
	m.depth, errs[4] = m.meter.Int64ObservableGauge(MetricQueueDepth, metric.WithUnit("{delivery}"),
		metric.WithDescription("Webhook deliveries pending or in flight, per endpoint."))
	m.breaker, errs[5] = m.meter.Int64ObservableGauge(MetricBreakerState, metric.WithUnit("1"),
		metric.WithDescription("Circuit breaker state per endpoint: 0 closed, 1 half-open, 2 open."))
	if err := errors.Join(errs[:]...); err != nil {
		return nil, fmt.Errorf("outbound: metrics: %w", err)
	}
	return m, nil
}

func (m *metrics) attrs(sub string) metric.MeasurementOption {
	return metric.WithAttributes(attrSubscription.String(sub))
}

func (m *metrics) recordDuration(ctx context.Context, sub string, dec decision) {
	outcome := "retry"
	switch {
	case dec.status == StatusDelivered:
		outcome = "delivered"
	case dec.interrupted:
		outcome = "interrupted"
	case dec.status == StatusDead:
		outcome = "dead"
	}
	attrs := []attribute.KeyValue{attrSubscription.String(sub), attrOutcome.String(outcome)}
	if dec.lastStatus != 0 {
		attrs = append(attrs, attrHTTPStatus.Int(dec.lastStatus))
	}
	m.duration.Record(ctx, dec.duration.Seconds(), metric.WithAttributes(attrs...))
}

var breakerValue = map[BreakerState]int64{BreakerClosed: 0, BreakerHalfOpen: 1, BreakerOpen: 2}

// observe registers the callback that reads queue depth and breaker states
// from the tables (the same figures from every dispatcher of a schema).
func (m *metrics) observe(d *Dispatcher) (metric.Registration, error) {
	return m.meter.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		rows, err := d.cfg.Pool.Query(ctx, d.q.depth)
		if err != nil {
			return err
		}
		var (
			sub    uuid.UUID
			status string
			n      int64
		)
		if _, err := pgx.ForEachRow(rows, []any{&sub, &status, &n}, func() error {
			o.ObserveInt64(m.depth, n, metric.WithAttributes(attrSubscription.String(sub.String()), attrStatus.String(status)))
			return nil
		}); err != nil {
			return err
		}
		rows, err = d.cfg.Pool.Query(ctx, d.q.breakers)
		if err != nil {
			return err
		}
		var state string
		_, err = pgx.ForEachRow(rows, []any{&sub, &state}, func() error {
			o.ObserveInt64(m.breaker, breakerValue[BreakerState(state)],
				metric.WithAttributes(attrSubscription.String(sub.String()), attrBreakerState.String(state)))
			return nil
		})
		return err
	}, m.depth, m.breaker)
}
