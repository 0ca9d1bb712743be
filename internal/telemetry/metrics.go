package telemetry

import (
	"fmt"
	"os"
	"strings"

	"go.opentelemetry.io/otel/metric"
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
