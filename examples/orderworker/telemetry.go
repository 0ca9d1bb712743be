package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlpmetric/otlpmetrichttp"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/oncely/oncely"
)

// serviceName is the worker's service.name, unless OTEL_SERVICE_NAME (or
// service.name in OTEL_RESOURCE_ATTRIBUTES) says otherwise.
const serviceName = "orderworker"

// telemetry is the worker's OpenTelemetry: the providers handed to the
// consumer and the relay (explicitly: nothing here is installed as a global
// provider), the /metrics handler, and the flush on exit.
//
//   - Metrics are always collected: GET /metrics serves them in the
//     Prometheus text format (names translated the Prometheus way:
//     messaging.client.consumed.messages becomes
//     messaging_client_consumed_messages_total), and with an OTLP endpoint
//     they are also pushed over OTLP/HTTP every OTEL_METRIC_EXPORT_INTERVAL
//     (default 60s) and once more on exit.
//   - Spans are recorded only when something exports them: OTLP/HTTP with an
//     endpoint set, stdout with --trace-stdout, or both. Otherwise the
//     tracer provider is a no-op and spans cost nothing.
//
// The OTLP exporters read the standard variables themselves
// (OTEL_EXPORTER_OTLP_ENDPOINT, ..._HEADERS, ..._TIMEOUT, their _TRACES_ and
// _METRICS_ variants, and so on), as do the batch span processor
// (OTEL_BSP_*), the periodic metric reader (OTEL_METRIC_EXPORT_*) and the
// resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES).
type telemetry struct {
	tracerProvider trace.TracerProvider
	meterProvider  metric.MeterProvider
	metrics        http.Handler // GET /metrics
	shutdown       func(context.Context) error
}

// newTelemetry sets up the worker's telemetry. Spans for --trace-stdout go
// to stdout; the SDK's own errors (an unreachable collector, say) go to log.
func newTelemetry(ctx context.Context, cfg workerConfig, stdout io.Writer, log *slog.Logger) (*telemetry, error) {
	// The SDK reports export failures through the global error handler,
	// whose default writes to stderr unstructured; the worker's log is the
	// place for them.
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		log.Warn("orderworker telemetry", "err", err)
	}))

	attrs := []attribute.KeyValue{semconv.ServiceName(serviceName)}
	if cfg.InstanceID != "" {
		attrs = append(attrs, semconv.ServiceInstanceID(cfg.InstanceID))
	}
	res, err := resource.New(ctx,
		resource.WithSchemaURL(semconv.SchemaURL),
		resource.WithAttributes(attrs...),
		resource.WithTelemetrySDK(),
		resource.WithFromEnv(), // last: the environment wins
	)
	if err != nil {
		return nil, fmt.Errorf("orderworker: telemetry resource: %w", err)
	}

	var shutdowns []func(context.Context) error
	t := &telemetry{shutdown: func(ctx context.Context) error {
		errs := make(chan error, len(shutdowns))
		for _, f := range shutdowns {
			go func() { errs <- f(ctx) }()
		}
		var all []error
		for range shutdowns {
			all = append(all, <-errs)
		}
		return errors.Join(all...)
	}}

	// Metrics: the runner's Prometheus exporter (its own registry, with
	// the Go runtime and process collectors), and OTLP when configured.
	prom, metrics, err := oncely.PrometheusExporter()
	if err != nil {
		return nil, err
	}
	readers := []sdkmetric.Option{sdkmetric.WithResource(res), sdkmetric.WithReader(prom)}
	if cfg.OTLPMetrics {
		exp, err := otlpmetrichttp.New(ctx)
		if err != nil {
			return nil, fmt.Errorf("orderworker: OTLP metric exporter: %w", err)
		}
		readers = append(readers, sdkmetric.WithReader(sdkmetric.NewPeriodicReader(exp)))
	}
	mp := sdkmetric.NewMeterProvider(readers...)
	shutdowns = append(shutdowns, mp.Shutdown)
	t.meterProvider = mp
	t.metrics = metrics

	// Traces.
	var processors []sdktrace.TracerProviderOption
	if cfg.OTLPTraces {
		exp, err := otlptracehttp.New(ctx)
		if err != nil {
			return nil, fmt.Errorf("orderworker: OTLP trace exporter: %w", err)
		}
		processors = append(processors, sdktrace.WithBatcher(exp))
	}
	if cfg.TraceStdout {
		exp, err := stdouttrace.New(stdouttrace.WithWriter(stdout))
		if err != nil {
			return nil, fmt.Errorf("orderworker: stdout trace exporter: %w", err)
		}
		// A local run wants to see its spans soon, not every 5s.
		processors = append(processors, sdktrace.WithBatcher(exp, sdktrace.WithBatchTimeout(time.Second)))
	}
	if len(processors) == 0 {
		t.tracerProvider = noop.NewTracerProvider()
	} else {
		tp := sdktrace.NewTracerProvider(append(processors, sdktrace.WithResource(res))...)
		shutdowns = append(shutdowns, tp.Shutdown)
		t.tracerProvider = tp
	}
	log.Info("orderworker telemetry", "otlp_traces", cfg.OTLPTraces, "otlp_metrics", cfg.OTLPMetrics,
		"trace_stdout", cfg.TraceStdout, "metrics", "GET /metrics")
	return t, nil
}

// otlpExport reports, from the standard variables, whether traces and
// metrics go to an OTLP endpoint. OTEL_TRACES_EXPORTER=none and
// OTEL_METRICS_EXPORTER=none turn either off; OTEL_SDK_DISABLED=true both.
// A protocol other than http/protobuf is an error: this worker ships the
// OTLP/HTTP exporters only, and silently sending nothing would be worse.
func otlpExport(getenv func(string) string) (traces, metrics bool, err error) {
	for _, k := range []string{"OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"} {
		if v := getenv(k); v != "" && v != "http/protobuf" {
			return false, false, invalidFlag(k, fmt.Errorf("%q: orderworker exports OTLP over HTTP only; want http/protobuf", v))
		}
	}
	if getenv("OTEL_SDK_DISABLED") == "true" {
		return false, false, nil
	}
	all := getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != ""
	traces = (all || getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != "") && getenv("OTEL_TRACES_EXPORTER") != "none"
	metrics = (all || getenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") != "") && getenv("OTEL_METRICS_EXPORTER") != "none"
	return traces, metrics, nil
}
