package telemetry

import (
	"context"
	"os"
	"regexp"
	"slices"
	"strconv"
	"testing"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// A 30 ms observation lands in the (0.025, 0.05] bucket of a duration
// histogram, not in the first bucket as with the SDK's default boundaries.
func TestDurationHistogramBucketsAreSeconds(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	h, err := DurationHistogram(mp.Meter("test"), "test.duration", "A test duration.")
	if err != nil {
		t.Fatal(err)
	}
	h.Record(context.Background(), 0.030)

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	m := rm.ScopeMetrics[0].Metrics[0]
	if m.Unit != "s" {
		t.Errorf("unit %q, want s", m.Unit)
	}
	dp := m.Data.(metricdata.Histogram[float64]).DataPoints[0]
	if !slices.Equal(dp.Bounds, DurationBuckets) {
		t.Fatalf("bounds %v, want %v", dp.Bounds, DurationBuckets)
	}
	// BucketCounts[i] counts (Bounds[i-1], Bounds[i]].
	i := slices.IndexFunc(dp.BucketCounts, func(n uint64) bool { return n == 1 })
	if i < 1 || dp.Bounds[i-1] != 0.025 || dp.Bounds[i] != 0.05 {
		t.Fatalf("the 30ms observation is in bucket %d of %v (bounds %v), want (0.025, 0.05]", i, dp.BucketCounts, dp.Bounds)
	}
}

func TestClientID(t *testing.T) {
	if got := ClientID("worker-7"); got != "worker-7" {
		t.Errorf("ClientID(worker-7) = %q", got)
	}
	got := ClientID("")
	if !regexp.MustCompile(`^oncely-[A-Za-z0-9._-]+-` + strconv.Itoa(os.Getpid()) + `$`).MatchString(got) {
		t.Errorf("ClientID(\"\") = %q, want oncely-<hostname>-<pid>", got)
	}
}
