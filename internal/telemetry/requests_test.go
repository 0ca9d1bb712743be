package telemetry

import (
	"context"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"go.opentelemetry.io/otel/trace/noop"
)

// TestRequestsCountByAttributes: requests are counted under their own
// attribute lists, whether the measurement option comes from the cache or
// not (five attributes are not cached).
func TestRequestsCountByAttributes(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	rq, err := NewRequests(noop.NewTracerProvider(), sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)), "c", "", "d", "")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	a := []attribute.KeyValue{attribute.String("outcome", "stored"), attribute.Int("code", 201)}
	b := []attribute.KeyValue{attribute.String("outcome", "replayed"), attribute.Int("code", 201)}
	five := []attribute.KeyValue{attribute.Bool("a", true), attribute.Bool("b", true), attribute.Bool("c", true), attribute.Bool("d", true), attribute.Bool("e", true)}
	for _, attrs := range [][]attribute.KeyValue{a, b, a, a, five, b} {
		_, span := rq.Start(ctx, "x")
		rq.End(ctx, span, time.Now(), attrs, nil, nil, "")
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if sum, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == "c" {
				for _, dp := range sum.DataPoints {
					got[dp.Attributes.Encoded(attribute.DefaultEncoder())] = dp.Value
				}
			}
		}
	}
	enc := func(attrs []attribute.KeyValue) string {
		set := attribute.NewSet(attrs...)
		return set.Encoded(attribute.DefaultEncoder())
	}
	want := map[string]int64{enc(a): 3, enc(b): 2, enc(five): 1}
	if len(got) != len(want) {
		t.Fatalf("counts %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("count of %s = %d, want %d", k, got[k], v)
		}
	}
}
