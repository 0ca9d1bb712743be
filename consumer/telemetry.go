package consumer

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/oncely/oncely/internal/telemetry"
)

// instruments are the consumer's OpenTelemetry metrics.
type instruments struct {
	consumed        metric.Int64Counter     // messaging.client.consumed.messages
	processDuration metric.Float64Histogram // messaging.process.duration
	sent            metric.Int64Counter     // messaging.client.sent.messages (dead-letter produces)
	duplicates      metric.Int64Counter
	retries         metric.Int64Counter
	contention      metric.Int64Counter
	deadLettered    metric.Int64Counter
	crashProbes     metric.Int64Counter
	commitLag       metric.Int64ObservableGauge
	inboxRows       metric.Int64ObservableGauge
	base            metric.MeasurementOption
}

func newInstruments(m metric.Meter, cfg *Config) (*instruments, error) {
	var in instruments
	var errs []error
	add := func(err error) { errs = append(errs, err) }
	var err error
	in.consumed, err = m.Int64Counter("messaging.client.consumed.messages", metric.WithUnit("{message}"),
		metric.WithDescription("Records handed to a partition worker."))
	add(err)
	in.processDuration, err = m.Float64Histogram("messaging.process.duration", metric.WithUnit("s"),
		metric.WithDescription("Duration of one processing attempt (transaction included)."))
	add(err)
	in.sent, err = m.Int64Counter("messaging.client.sent.messages", metric.WithUnit("{message}"),
		metric.WithDescription("Records oncely produced (outbox relay, dead-letter writes); error.type is set when the produce failed."))
	add(err)
	in.duplicates, err = m.Int64Counter("oncely.consumer.duplicates", metric.WithUnit("{message}"),
		metric.WithDescription("Records skipped because the inbox already held their id."))
	add(err)
	in.retries, err = m.Int64Counter("oncely.consumer.retries", metric.WithUnit("{attempt}"),
		metric.WithDescription("Failed attempts that were retried."))
	add(err)
	in.contention, err = m.Int64Counter("oncely.consumer.contention", metric.WithUnit("{message}"),
		metric.WithDescription("Records whose transaction lost to another (deadlock, serialization failure, lock timeout) and ran again without spending an attempt."))
	add(err)
	in.deadLettered, err = m.Int64Counter("oncely.consumer.dead_lettered", metric.WithUnit("{message}"),
		metric.WithDescription("Records written to a dead-letter topic."))
	add(err)
	in.crashProbes, err = m.Int64Counter("oncely.consumer.crash_probes", metric.WithUnit("{partition}"),
		metric.WithDescription("Partitions that started in probe, one record at a time, because their previous owner died."))
	add(err)
	in.commitLag, err = m.Int64ObservableGauge("oncely.consumer.commit_lag", metric.WithUnit("{message}"),
		metric.WithDescription("Per partition: high watermark minus the offset committed by this member."))
	add(err)
	in.inboxRows, err = m.Int64ObservableGauge("oncely.inbox.rows", metric.WithUnit("{row}"),
		metric.WithDescription("Estimated rows in the inbox table (planner statistics)."))
	add(err)
	in.base = metric.WithAttributes(telemetry.Kafka, telemetry.MessagingConsumerGroup.String(cfg.Group))
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("consumer: metrics: %w", err)
	}
	return &in, nil
}

// observe registers the gauges that read the live run.
func (r *run) observe() (metric.Registration, error) {
	c := r.c
	return c.meter.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		for _, w := range r.snapshot() {
			hwm := w.hwm.Load()
			w.mu.Lock()
			committed := w.lastCommit
			w.mu.Unlock()
			if hwm <= 0 || committed < 0 {
				continue
			}
			o.ObserveInt64(c.metrics.commitLag, max(hwm-committed, 0), metric.WithAttributes(
				telemetry.Kafka, telemetry.MessagingConsumerGroup.String(c.cfg.Group),
				telemetry.MessagingDestination.String(w.tp.topic),
				telemetry.MessagingPartition.String(strconv.FormatInt(int64(w.tp.partition), 10))))
		}
		var rows int64
		if err := c.cfg.Pool.QueryRow(ctx, `SELECT greatest(reltuples, 0)::bigint FROM pg_class WHERE oid = to_regclass($1)`,
			c.cfg.Schema+".inbox").Scan(&rows); err == nil {
			o.ObserveInt64(c.metrics.inboxRows, rows, metric.WithAttributes(attribute.String("db.namespace", c.cfg.Schema)))
		}
		return nil
	}, c.metrics.commitLag, c.metrics.inboxRows)
}

// topicAttrs are the metric attributes of a record's topic.
func (c *Consumer) topicAttrs(rec *kgo.Record) metric.MeasurementOption {
	return c.metricAttrs(attrKey{topic: rec.Topic})
}

// attrKey names one of the few attribute sets the consumer's metrics use:
// per topic, for processing (with its error type, if any) or not.
type attrKey struct {
	topic     string
	process   bool
	errorType string
}

// metricAttrs returns the attribute set of k, built once: building a set
// per record costs as much as the rest of a batch's bookkeeping.
func (c *Consumer) metricAttrs(k attrKey) metric.MeasurementOption {
	if o, ok := c.attrSets.Load(k); ok {
		return o.(metric.MeasurementOption)
	}
	kv := []attribute.KeyValue{telemetry.Kafka, telemetry.MessagingConsumerGroup.String(c.cfg.Group),
		telemetry.MessagingDestination.String(k.topic)}
	if k.process {
		kv = append(kv, telemetry.MessagingOperationName.String("process"))
	}
	if k.errorType != "" {
		kv = append(kv, telemetry.ErrorType.String(k.errorType))
	}
	o, _ := c.attrSets.LoadOrStore(k, metric.WithAttributeSet(attribute.NewSet(kv...)))
	return o.(metric.MeasurementOption)
}

// startSendSpan starts the dead-letter "send <topic>" PRODUCER span, a child
// of the failed attempt and linked to it.
func (c *Consumer) startSendSpan(ctx context.Context, topic string, failed trace.SpanContext, id string) (context.Context, trace.Span) {
	opts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(
		telemetry.Kafka, telemetry.MessagingDestination.String(topic),
		telemetry.MessagingOperationType.String("send"), telemetry.MessagingOperationName.String("send"),
		telemetry.MessagingMessageID.String(id))}
	if failed.IsValid() {
		ctx = trace.ContextWithSpanContext(ctx, failed)
		opts = append(opts, trace.WithLinks(trace.Link{SpanContext: failed}))
	}
	return c.tracer.Start(ctx, "send "+topic, opts...)
}
