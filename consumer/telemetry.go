package consumer

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/oncely/oncely/internal/sqlident"
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
	turnWaits       metric.Int64Counter
	deadLettered    metric.Int64Counter
	crashProbes     metric.Int64Counter
	idFallback      metric.Int64Counter
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
	in.processDuration, err = telemetry.DurationHistogram(m, "messaging.process.duration",
		"Duration of one processing attempt (transaction included).")
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
	in.turnWaits, err = m.Int64Counter("oncely.consumer.turn_waits", metric.WithUnit("{transaction}"),
		metric.WithDescription("Transactions that waited, in the process, for another of this member sharing a conflict key to end (ConflictKeys)."))
	add(err)
	in.deadLettered, err = m.Int64Counter("oncely.consumer.dead_lettered", metric.WithUnit("{message}"),
		metric.WithDescription("Records written to a dead-letter topic."))
	add(err)
	in.crashProbes, err = m.Int64Counter("oncely.consumer.crash_probes", metric.WithUnit("{partition}"),
		metric.WithDescription("Partitions that started in probe, one record at a time, because their previous owner died."))
	add(err)
	in.idFallback, err = m.Int64Counter("oncely.consumer.id_fallback", metric.WithUnit("{message}"),
		metric.WithDescription("Records without a message id (no KeyFunc, no id header) deduplicated by topic/partition/offset, which does not catch a producer's duplicate."))
	add(err)
	in.commitLag, err = m.Int64ObservableGauge("oncely.consumer.commit_lag", metric.WithUnit("{message}"),
		metric.WithDescription("Per partition: high watermark minus the offset committed by this member."))
	add(err)
	in.inboxRows, err = m.Int64ObservableGauge("oncely.inbox.rows_estimate", metric.WithUnit("{row}"),
		metric.WithDescription("Rows in the inbox table: the planner's estimate scaled to the table's size, or an exact count (at most every 30s) while the table has no statistics."))
	add(err)
	in.base = metric.WithAttributes(systemAttr(cfg), telemetry.MessagingConsumerGroup.String(cfg.Group))
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
		if rows, err := c.inboxRows(ctx); err == nil {
			o.ObserveInt64(c.metrics.inboxRows, rows, metric.WithAttributes(attribute.String("db.namespace", c.cfg.Schema)))
		}
		return nil
	}, c.metrics.commitLag, c.metrics.inboxRows)
}

// inboxCountInterval bounds how often inboxRows counts the inbox exactly.
const inboxCountInterval = 30 * time.Second

// inboxRows returns the inbox's row count for the rows_estimate gauge: the
// planner's estimate (reltuples per page times the table's current pages,
// as the planner scales it), which costs nothing. A table the planner has
// no statistics of (never analyzed: reltuples -1; analyzed while empty: 0)
// would read 0 however many rows it holds; it is counted exactly instead,
// at most once per inboxCountInterval (the last count is reported between).
func (c *Consumer) inboxRows(ctx context.Context) (int64, error) {
	estimate, err := c.inbox.EstimateRows(ctx, c.cfg.Pool)
	if err != nil || estimate >= 0 {
		return estimate, err
	}
	table := sqlident.Table(c.cfg.Schema, "inbox")
	c.inboxCount.Lock()
	defer c.inboxCount.Unlock()
	if !c.inboxCount.at.IsZero() && time.Since(c.inboxCount.at) < inboxCountInterval {
		return c.inboxCount.rows, nil
	}
	if err := c.cfg.Pool.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&c.inboxCount.rows); err != nil {
		return 0, err
	}
	c.inboxCount.at = time.Now()
	return c.inboxCount.rows, nil
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
	kv := []attribute.KeyValue{c.system, telemetry.MessagingConsumerGroup.String(c.cfg.Group),
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
		c.system, telemetry.MessagingDestination.String(topic),
		telemetry.MessagingOperationType.String("send"), telemetry.MessagingOperationName.String("send"),
		telemetry.MessagingMessageID.String(id))}
	if failed.IsValid() {
		ctx = trace.ContextWithSpanContext(ctx, failed)
		opts = append(opts, trace.WithLinks(trace.Link{SpanContext: failed}))
	}
	return c.tracer.Start(ctx, "send "+topic, opts...)
}

// systemAttr is messaging.system of cfg's consumer: kafka, or the broker a
// record path was made for (NewRecordPath).
func systemAttr(cfg *Config) attribute.KeyValue {
	if cfg.system == "" {
		return telemetry.Kafka
	}
	return telemetry.MessagingSystem.String(cfg.system)
}
