// Package telemetry holds what oncely's packages share for OpenTelemetry:
// the Kafka record-header carrier for W3C trace context (the same header
// keys as franz-go's kotel plugin, so instrumented services interoperate),
// the messaging semantic-convention attribute keys, and span helpers.
package telemetry

import (
	"context"
	"strconv"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of oncely's tracers and meters.
const ScopeName = "github.com/oncely/oncely"

// Attribute keys: OpenTelemetry messaging semantic conventions, plus
// oncely's own under the oncely. prefix.
const (
	MessagingSystem        = attribute.Key("messaging.system")
	MessagingOperationType = attribute.Key("messaging.operation.type")
	MessagingOperationName = attribute.Key("messaging.operation.name")
	MessagingDestination   = attribute.Key("messaging.destination.name")
	MessagingPartition     = attribute.Key("messaging.destination.partition.id")
	MessagingKafkaOffset   = attribute.Key("messaging.kafka.offset")
	MessagingKafkaKey      = attribute.Key("messaging.kafka.message.key")
	// RabbitMQ's own: the routing key a message was published with, and
	// the delivery tag of its delivery.
	MessagingRabbitMQRoutingKey  = attribute.Key("messaging.rabbitmq.destination.routing_key")
	MessagingRabbitMQDeliveryTag = attribute.Key("messaging.rabbitmq.message.delivery_tag")
	MessagingConsumerGroup       = attribute.Key("messaging.consumer.group.name")
	MessagingMessageID           = attribute.Key("messaging.message.id")
	MessagingBatchCount          = attribute.Key("messaging.batch.message_count")
	ErrorType                    = attribute.Key("error.type")

	// HTTP semantic conventions, for the HTTP middleware and receivers.
	HTTPRequestMethod      = attribute.Key("http.request.method")
	HTTPResponseStatusCode = attribute.Key("http.response.status_code")

	Attempt      = attribute.Key("oncely.attempt")
	DedupOutcome = attribute.Key("oncely.dedup.outcome") // new | duplicate | redrive
	DLQClass     = attribute.Key("oncely.dlq.error_class")
)

// Kafka is messaging.system=kafka.
var Kafka = MessagingSystem.String("kafka")

// MaxTraceStateLen bounds an accepted tracestate header; longer values are
// dropped rather than propagated (W3C allows 512 bytes of list members).
const MaxTraceStateLen = 512

// Carrier adapts kgo record headers to a propagation.TextMapCarrier.
type Carrier struct{ Headers *[]kgo.RecordHeader }

// Get returns the first header named key.
func (c Carrier) Get(key string) string {
	for _, h := range *c.Headers {
		if h.Key == key {
			if key == "tracestate" && len(h.Value) > MaxTraceStateLen {
				return ""
			}
			return string(h.Value)
		}
	}
	return ""
}

// Set replaces (or adds) the header named key.
func (c Carrier) Set(key, value string) {
	for i, h := range *c.Headers {
		if h.Key == key {
			(*c.Headers)[i].Value = []byte(value)
			return
		}
	}
	*c.Headers = append(*c.Headers, kgo.RecordHeader{Key: key, Value: []byte(value)})
}

// Keys lists the header keys.
func (c Carrier) Keys() []string {
	keys := make([]string, len(*c.Headers))
	for i, h := range *c.Headers {
		keys[i] = h.Key
	}
	return keys
}

var propagator = propagation.TraceContext{}

// Extract returns the span context carried by headers (invalid if none).
func Extract(headers []kgo.RecordHeader) trace.SpanContext {
	return trace.SpanContextFromContext(propagator.Extract(context.Background(), Carrier{&headers}))
}

// Inject writes ctx's span context into headers.
func Inject(ctx context.Context, headers *[]kgo.RecordHeader) {
	propagator.Inject(ctx, Carrier{headers})
}

// TraceContext returns ctx's traceparent and tracestate header values.
func TraceContext(ctx context.Context) (traceparent, tracestate string) {
	m := propagation.MapCarrier{}
	propagator.Inject(ctx, m)
	return m["traceparent"], m["tracestate"]
}

// Tracer returns oncely's tracer from tp, or from the global provider.
func Tracer(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return tp.Tracer(ScopeName)
}

// Meter returns oncely's meter from mp, or from the global provider.
func Meter(mp metric.MeterProvider) metric.Meter {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	return mp.Meter(ScopeName)
}

// RecordAttrs are the semantic-convention attributes of a record.
func RecordAttrs(rec *kgo.Record) []attribute.KeyValue {
	return []attribute.KeyValue{
		Kafka,
		MessagingDestination.String(rec.Topic),
		MessagingPartition.String(strconv.FormatInt(int64(rec.Partition), 10)),
		MessagingKafkaOffset.Int64(rec.Offset),
	}
}

// Fail marks span as failed with err, with error.type set to kind.
func Fail(span trace.Span, err error, kind string) {
	span.RecordError(err)
	span.SetStatus(codes.Error, err.Error())
	span.SetAttributes(ErrorType.String(kind))
}
