package telemetry

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// DurationBuckets are the bucket boundaries, in seconds, of every oncely
// duration histogram: from a millisecond (a claim and commit on a local
// database) to a minute (a handler or a webhook endpoint at its timeout).
// The SDK's default boundaries (0, 5, 10 ... 10000) are meant for
// milliseconds: in seconds every observation would fall in the first bucket.
var DurationBuckets = []float64{
	0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
	1, 2.5, 5, 7.5, 10, 30, 60,
}

// DurationHistogram creates a histogram of durations in seconds (unit "s")
// with DurationBuckets as its bucket boundaries.
func DurationHistogram(m metric.Meter, name, description string) (metric.Float64Histogram, error) {
	return m.Float64Histogram(name, metric.WithUnit("s"), metric.WithDescription(description),
		metric.WithExplicitBucketBoundaries(DurationBuckets...))
}

// ClientID returns id, or when id is empty "oncely-<hostname>-<pid>": the
// Kafka client id oncely's clients send, which brokers log and apply quotas
// to. Characters outside [A-Za-z0-9._-] in the hostname become '-'.
func ClientID(id string) string {
	if id != "" {
		return id
	}
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown"
	}
	host = strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '.', r == '_', r == '-':
			return r
		}
		return '-'
	}, host)
	return fmt.Sprintf("oncely-%s-%d", host, os.Getpid())
}

// Requests instruments a request handler (the webhook receiver, the
// idempotency middleware): an INTERNAL span per request, a counter of
// requests and a duration histogram, both by the request's outcome.
type Requests struct {
	tracer   trace.Tracer
	count    metric.Int64Counter
	duration metric.Float64Histogram
	// sets caches the Measure of each attribute list seen (there are a
	// few dozen: method x outcome x refusal), so that a request does not
	// build and hash an attribute.Set.
	sets sync.Map // setKey -> *Measure
}

// setKey is an attribute list of up to four attributes as a map key.
type setKey [4]attribute.KeyValue

// NewRequests creates the counter (unit {request}) and the duration
// histogram of a Requests from mp, and its tracer from tp (nil: the
// global providers).
func NewRequests(tp trace.TracerProvider, mp metric.MeterProvider, counter, counterDesc, histogram, histogramDesc string) (*Requests, error) {
	m := Meter(mp)
	count, err1 := m.Int64Counter(counter, metric.WithUnit("{request}"), metric.WithDescription(counterDesc))
	duration, err2 := DurationHistogram(m, histogram, histogramDesc)
	if err := errors.Join(err1, err2); err != nil {
		return nil, err
	}
	return &Requests{tracer: Tracer(tp), count: count, duration: duration}, nil
}

// Start starts the INTERNAL span name of a request.
func (rq *Requests) Start(ctx context.Context, name string, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	return rq.StartWith(ctx, name, SpanOptions(attrs...))
}

// SpanOptions returns the start options of an INTERNAL request span with
// attrs: build them once for attributes every request shares, and pass them
// to StartWith.
func SpanOptions(attrs ...attribute.KeyValue) []trace.SpanStartOption {
	return []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(attrs...)}
}

// StartWith starts the span name of a request with opts from SpanOptions.
func (rq *Requests) StartWith(ctx context.Context, name string, opts []trace.SpanStartOption) (context.Context, trace.Span) {
	return rq.tracer.Start(ctx, name, opts...)
}

// End counts a request that began at start and records its duration, both
// with the attributes attrs; sets attrs and spanAttrs on span, marks it
// failed when err is not nil (error.type errType), and ends it.
func (rq *Requests) End(ctx context.Context, span trace.Span, start time.Time, attrs, spanAttrs []attribute.KeyValue, err error, errType string) {
	rq.EndMeasure(ctx, span, start, rq.Measure(attrs...), spanAttrs, err, errType)
}

// Measure is a metric attribute list of requests with its measurement
// options, built once (Requests.Measure caches it) so that counting a
// request allocates nothing.
type Measure struct {
	attrs []attribute.KeyValue
	add   []metric.AddOption
	rec   []metric.RecordOption
}

// EndMeasure is End with the attributes of m.
func (rq *Requests) EndMeasure(ctx context.Context, span trace.Span, start time.Time, m *Measure, spanAttrs []attribute.KeyValue, err error, errType string) {
	rq.count.Add(ctx, 1, m.add...)
	rq.duration.Record(ctx, time.Since(start).Seconds(), m.rec...)
	if span.IsRecording() {
		span.SetAttributes(m.attrs...)
		span.SetAttributes(spanAttrs...)
	}
	if err != nil {
		Fail(span, err, errType)
	}
	span.End()
}

// Measure returns the Measure of attrs, cached when attrs holds four
// attributes or fewer, each of a comparable value (strings, numbers,
// booleans: every attribute oncely's requests carry).
func (rq *Requests) Measure(attrs ...attribute.KeyValue) *Measure {
	if len(attrs) > len(setKey{}) {
		return newMeasure(attrs)
	}
	var k setKey
	for i, a := range attrs {
		switch a.Value.Type() {
		case attribute.STRING, attribute.INT64, attribute.FLOAT64, attribute.BOOL:
		default:
			return newMeasure(attrs)
		}
		k[i] = a
	}
	if m, ok := rq.sets.Load(k); ok {
		return m.(*Measure)
	}
	m, _ := rq.sets.LoadOrStore(k, newMeasure(attrs))
	return m.(*Measure)
}

func newMeasure(attrs []attribute.KeyValue) *Measure {
	set := metric.WithAttributeSet(attribute.NewSet(attrs...))
	return &Measure{attrs: slices.Clone(attrs), add: []metric.AddOption{set}, rec: []metric.RecordOption{set}}
}
