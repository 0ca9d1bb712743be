package integration_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testhook"
	"github.com/oncely/oncely/outbox"
	"github.com/oncely/oncely/webhook"
)

// tel is an in-memory span recorder and metric reader.
type tel struct {
	spans  *tracetest.SpanRecorder
	tp     *sdktrace.TracerProvider
	reader *sdkmetric.ManualReader
	mp     *sdkmetric.MeterProvider
}

func newTel(t *testing.T) *tel {
	rec := tracetest.NewSpanRecorder()
	reader := sdkmetric.NewManualReader()
	tl := &tel{spans: rec, tp: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)),
		reader: reader, mp: sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))}
	t.Cleanup(func() { _ = tl.tp.Shutdown(context.Background()); _ = tl.mp.Shutdown(context.Background()) })
	return tl
}

func (tl *tel) ended(name string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range tl.spans.Ended() {
		if name == "" || s.Name() == name {
			out = append(out, s)
		}
	}
	return out
}

func attrs(s sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes() {
		m[kv.Key] = kv.Value
	}
	return m
}

func linkedTo(s sdktrace.ReadOnlySpan, sc trace.SpanContext) bool {
	for _, l := range s.Links() {
		if l.SpanContext.SpanID() == sc.SpanID() && l.SpanContext.TraceID() == sc.TraceID() {
			return true
		}
	}
	return false
}

// sum reads a counter's total from the reader.
func (tl *tel) sum(t *testing.T, name string) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := tl.reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var total int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			if s, ok := m.Data.(metricdata.Sum[int64]); ok {
				for _, dp := range s.DataPoints {
					total += dp.Value
				}
			}
		}
	}
	return total
}

// One trace from a webhook delivery through the outbox, the relay, a
// consumer whose first attempt fails, the events its handler publishes, the
// relay again and a second consumer group.
func TestTraceFollowsMessageAcrossServices(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	tl := newTel(t)
	ctx := context.Background()
	events := e.kafka.CreateTopic(t, "events", 1)
	e.kafka.CreateTopicNamed(t, dlq.DefaultTopic(events), 1) // the second group consumes it
	ob := e.outbox(t)
	e.startRelay(ctx, t, func(c *outbox.RelayConfig) { c.TracerProvider, c.MeterProvider = tl.tp, tl.mp })

	// The chain starts at a webhook: the receiver runs behind otelhttp, as
	// an instrumented server would, and enqueues inside the request's span.
	v, err := webhook.NewStandardWebhooks(webhook.VerifierConfig{Secrets: []string{webhookSecret}})
	if err != nil {
		t.Fatal(err)
	}
	rc, err := webhook.New(webhook.Config{Pool: e.db.Pool, Outbox: outbox.Config{Schema: e.db.Schema, Shards: 16}, Topic: e.topic, Verifier: v})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(otelhttp.NewHandler(rc, "POST /webhooks/orders", otelhttp.WithTracerProvider(tl.tp)))
	t.Cleanup(srv.Close)
	if status, _ := signWebhook(t, webhookSecret, "msg_trace_1", []byte(`{"order_id":"o-1"}`), time.Now()).post(t, http.MethodPost, srv.URL, true); status != http.StatusAccepted {
		t.Fatalf("webhook answered %d", status)
	}
	// The server span ends just after the response is written.
	var api sdktrace.ReadOnlySpan
	eventually(t, 10*time.Second, "the webhook's server span", func() bool {
		for _, sp := range tl.ended("") {
			if sp.SpanKind() == trace.SpanKindServer {
				api = sp
			}
		}
		return api != nil
	})

	cfgA := e.config("a", func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if msg.Attempt == 1 {
			return errors.New("transient")
		}
		_, err := ob.Enqueue(ctx, tx, outbox.Message{Topic: events, Key: msg.Key, Value: []byte("accepted")})
		return err
	})
	cfgA.TracerProvider, cfgA.MeterProvider = tl.tp, tl.mp
	a := e.start(ctx, cfgA)
	cfgB := e.config("b", recordEffect("b"))
	cfgB.Topics, cfgB.Group = []string{events}, e.group+"-next"
	cfgB.TracerProvider, cfgB.MeterProvider = tl.tp, tl.mp
	b := e.start(ctx, cfgB)
	eventually(t, time.Minute, "the event processed by the second group", func() bool { return b.c.Stats().Processed == 1 })
	eventually(t, 10*time.Second, "spans ended", func() bool { return len(tl.ended("process "+events)) == 1 })

	traceID := api.SpanContext().TraceID()
	for _, s := range tl.ended("") {
		if s.SpanContext().TraceID() != traceID {
			t.Errorf("span %q is in trace %s, want %s", s.Name(), s.SpanContext().TraceID(), traceID)
		}
	}
	sendA := tl.ended("send " + e.topic)
	procA := tl.ended("process " + e.topic)
	sendB := tl.ended("send " + events)
	procB := tl.ended("process " + events)
	if len(sendA) != 1 || len(procA) != 2 || len(sendB) != 1 || len(procB) != 1 {
		t.Fatalf("spans: send A %d, process A %d, send B %d, process B %d; want 1, 2, 1, 1", len(sendA), len(procA), len(sendB), len(procB))
	}
	if sendA[0].Parent().SpanID() != api.SpanContext().SpanID() || sendA[0].SpanKind() != trace.SpanKindProducer {
		t.Error("the relay's send span does not continue the webhook request's span")
	}
	for i, s := range procA {
		at := attrs(s)
		if s.SpanKind() != trace.SpanKindConsumer || at["oncely.attempt"].AsInt64() != int64(i+1) ||
			at["messaging.system"].AsString() != "kafka" || at["messaging.operation.type"].AsString() != "process" ||
			at["messaging.destination.name"].AsString() != e.topic || at["messaging.destination.partition.id"].AsString() != "0" ||
			at["messaging.consumer.group.name"].AsString() != e.group || at["messaging.message.id"].AsString() == "" {
			t.Errorf("process span %d attributes %v", i, at)
		}
		if _, ok := at["messaging.kafka.offset"]; !ok {
			t.Errorf("process span %d has no offset", i)
		}
		if _, ok := at["messaging.kafka.message.key"]; ok {
			t.Error("the record key was recorded without being configured")
		}
		if !linkedTo(s, sendA[0].SpanContext()) || s.Parent().SpanID() != sendA[0].SpanContext().SpanID() {
			t.Errorf("process span %d is not linked and parented to the creation (send) span", i)
		}
	}
	if procA[0].Status().Code != codes.Error || attrs(procA[0])["error.type"].AsString() != "handler" {
		t.Errorf("attempt 1: status %v, error.type %v", procA[0].Status(), attrs(procA[0])["error.type"])
	}
	if attrs(procA[1])["oncely.dedup.outcome"].AsString() != "new" {
		t.Errorf("attempt 2 outcome %v", attrs(procA[1])["oncely.dedup.outcome"])
	}
	if sendB[0].Parent().SpanID() != procA[1].SpanContext().SpanID() || procB[0].Parent().SpanID() != sendB[0].SpanContext().SpanID() {
		t.Error("the follow-up event's spans do not hang off the successful attempt")
	}
	if got := tl.sum(t, "messaging.client.consumed.messages"); got != 2 {
		t.Errorf("consumed = %d, want 2 (one record per group)", got)
	}
	if got := tl.sum(t, "oncely.consumer.retries"); got != 1 {
		t.Errorf("retries metric = %d, want 1", got)
	}
	if got := tl.sum(t, "messaging.client.sent.messages"); got != 2 {
		t.Errorf("sent = %d, want 2 (relay, both topics)", got)
	}
	_ = a
}

// A crash after the commit and a redelivery to another member: the
// duplicate is a linked process span with outcome duplicate.
func TestRedeliveredDuplicateIsALinkedSpan(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	tl := newTel(t)
	ctx := context.Background()
	prodCtx, prod := tl.tp.Tracer("test").Start(ctx, "producer")
	rec := e.rec(0, "m-1", "v")
	injectInto(prodCtx, rec)
	prod.End()
	e.produceRecords(t, rec)

	hooks := &testhook.Consumer{AfterCommit: func(*kgo.Record) error { return testhook.ErrCrash }}
	cfg := e.config("a", recordEffect("a"))
	cfg.TracerProvider, cfg.MeterProvider = tl.tp, tl.mp
	first := e.start(testhook.WithConsumer(ctx, hooks), cfg)
	if err := first.wait(t, time.Minute); !errors.Is(err, testhook.ErrCrash) {
		t.Fatal(err)
	}
	cfg2 := e.config("b", recordEffect("b"))
	cfg2.TracerProvider, cfg2.MeterProvider = tl.tp, tl.mp
	second := e.start(ctx, cfg2)
	eventually(t, time.Minute, "the redelivery skipped", func() bool { return second.c.Stats().Duplicates == 1 })
	eventually(t, 10*time.Second, "two process spans", func() bool { return len(tl.ended("process "+e.topic)) == 2 })
	spans := tl.ended("process " + e.topic)
	outcomes := []string{attrs(spans[0])["oncely.dedup.outcome"].AsString(), attrs(spans[1])["oncely.dedup.outcome"].AsString()}
	if outcomes[0] != "new" || outcomes[1] != "duplicate" {
		t.Errorf("outcomes %v, want [new duplicate]", outcomes)
	}
	for _, s := range spans {
		if !linkedTo(s, prod.SpanContext()) || s.SpanContext().TraceID() != prod.SpanContext().TraceID() {
			t.Errorf("span %s not linked to the creation context", s.SpanContext().SpanID())
		}
	}
	if got := tl.sum(t, "oncely.consumer.duplicates"); got != 1 {
		t.Errorf("duplicates metric = %d, want 1", got)
	}
}

// The dead-letter hop and the redrive stay on the message's trace.
func TestDeadLetterAndRedriveKeepTheChain(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	e.createDLQTopic(t)
	tl := newTel(t)
	ctx := context.Background()
	prodCtx, prod := tl.tp.Tracer("test").Start(ctx, "producer")
	rec := e.rec(0, "poison", valueOf("poison", -1))
	injectInto(prodCtx, rec)
	prod.End()
	e.produceRecords(t, rec)
	cfg := e.config("a", orderHandler("a"))
	cfg.TracerProvider, cfg.MeterProvider = tl.tp, tl.mp
	m := e.start(ctx, cfg)
	eventually(t, time.Minute, "dead-lettered", func() bool { return m.c.Stats().DeadLettered == 1 })
	eventually(t, 10*time.Second, "send span ended", func() bool { return len(tl.ended("send "+dlq.DefaultTopic(e.topic))) == 1 })
	failed := tl.ended("process " + e.topic)[0]
	send := tl.ended("send " + dlq.DefaultTopic(e.topic))[0]
	if send.Parent().SpanID() != failed.SpanContext().SpanID() || !linkedTo(send, failed.SpanContext()) || send.SpanKind() != trace.SpanKindProducer {
		t.Error("the dead-letter send span is not a linked child of the failed attempt")
	}
	entries := e.dlqEntries(t)
	hdr := map[string]string{}
	for _, h := range entries[0].Record.Headers {
		hdr[h.Key] = string(h.Value)
	}
	if hdr[dlq.HeaderOriginalTraceParent] != traceparentOf(prod.SpanContext()) || hdr["traceparent"] != traceparentOf(send.SpanContext()) ||
		hdr[dlq.HeaderTraceParent] != traceparentOf(failed.SpanContext()) {
		t.Errorf("dead-letter trace headers %v", hdr)
	}
	if err := m.stop(t); err != nil {
		t.Fatal(err)
	}
	// v2 accepts it; the redriven record is processed on the original trace.
	cfg2 := e.config("v2", consumer.JSON(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message, _ order) error {
		return recordEffect("v2")(ctx, tx, msg)
	}))
	cfg2.TracerProvider, cfg2.MeterProvider = tl.tp, tl.mp
	v2 := e.start(ctx, cfg2)
	if _, err := dlq.Redrive(ctx, e.kafka.Client(t), entries, dlq.RedriveOptions{Inbox: dedup.MustNew(e.db.Schema), DB: e.db.Pool}); err != nil {
		t.Fatal(err)
	}
	eventually(t, time.Minute, "redrive processed", func() bool { return v2.c.Stats().Processed == 1 })
	eventually(t, 10*time.Second, "span ended", func() bool { return len(tl.ended("process "+e.topic)) == 2 })
	redriven := tl.ended("process " + e.topic)[1]
	if !linkedTo(redriven, prod.SpanContext()) || attrs(redriven)["oncely.dedup.outcome"].AsString() != "redrive" {
		t.Errorf("redriven process span: links %v, outcome %v", redriven.Links(), attrs(redriven)["oncely.dedup.outcome"])
	}
	if got := tl.sum(t, "oncely.consumer.dead_lettered"); got != 1 {
		t.Errorf("dead_lettered metric = %d, want 1", got)
	}
}

func traceparentOf(sc trace.SpanContext) string {
	return "00-" + sc.TraceID().String() + "-" + sc.SpanID().String() + "-" + sc.TraceFlags().String()
}

// For topics fed from outside, a process span starts a new trace linked to
// the producer's context instead of adopting its trace id; an oversized
// tracestate is not propagated.
func TestUntrustedProducersStartNewTraces(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	tl := newTel(t)
	ctx := context.Background()
	prodCtx, prod := tl.tp.Tracer("test").Start(ctx, "outside producer")
	rec := e.rec(0, "ext-1", "v")
	injectInto(prodCtx, rec)
	rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: "tracestate", Value: []byte("k=" + strings.Repeat("x", 600))})
	prod.End()
	e.produceRecords(t, rec)
	cfg := e.config("a", recordEffect("a"))
	cfg.TracerProvider, cfg.UntrustedProducers = tl.tp, true
	m := e.start(ctx, cfg)
	eventually(t, time.Minute, "processed", func() bool { return m.c.Stats().Processed == 1 })
	eventually(t, 10*time.Second, "span ended", func() bool { return len(tl.ended("process "+e.topic)) == 1 })
	s := tl.ended("process " + e.topic)[0]
	if s.SpanContext().TraceID() == prod.SpanContext().TraceID() || s.Parent().IsValid() {
		t.Error("the process span adopted the untrusted producer's trace")
	}
	if !linkedTo(s, prod.SpanContext()) {
		t.Error("the process span is not linked to the producer's context")
	}
	if len(s.Links()) == 1 && s.Links()[0].SpanContext.TraceState().Len() != 0 {
		t.Error("an oversized tracestate was propagated")
	}
}
