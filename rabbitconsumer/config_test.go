package rabbitconsumer

import (
	"errors"
	"strings"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"
)

// Each invalid setting fails New with ErrInvalidConfig and the field's name.
func TestNewNamesTheInvalidField(t *testing.T) {
	const url = "amqp://guest:guest@127.0.0.1:5672/"
	q := []string{"orders"}
	for _, tc := range []struct {
		field string
		cfg   Config
	}{
		{"URL", Config{Queues: q, Group: "g"}},
		{"URL", Config{URL: "http://x", Queues: q, Group: "g"}},
		{"Queues", Config{URL: url, Group: "g"}},
		{"Queues", Config{URL: url, Queues: []string{"a", "a"}, Group: "g"}},
		{"Queues", Config{URL: url, Queues: []string{""}, Group: "g"}},
		{"Group", Config{URL: url, Queues: q}},
		{"Group", Config{URL: url, Queues: q, Group: strings.Repeat("g", 201)}},
		{"Concurrency", Config{URL: url, Queues: q, Group: "g", Concurrency: -1}},
		{"Prefetch", Config{URL: url, Queues: q, Group: "g", Concurrency: 4, Prefetch: 2}},
		{"Prefetch", Config{URL: url, Queues: q, Group: "g", Concurrency: 2, BatchSize: 10, Prefetch: 19}},
		{"BatchSize", Config{URL: url, Queues: q, Group: "g", BatchSize: -1}},
		{"DeadLetterRoutingKey", Config{URL: url, Queues: q, Group: "g", DeadLetterRoutingKey: func(q string) string { return q }}},
		{"RetryQueue", Config{URL: url, Queues: q, Group: "g", RetryQueue: func(string) string { return "orders" }}},
		{"RetryQueue", Config{URL: url, Queues: q, Group: "g", RetryQueue: func(string) string { return "orders.dlq" }}},
		{"ShutdownTimeout", Config{URL: url, Queues: q, Group: "g", ShutdownTimeout: -1}},
		{"Pool", Config{URL: url, Queues: q, Group: "g"}},
	} {
		field := tc.field
		_, err := New(tc.cfg)
		if !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), field) {
			t.Errorf("%s: got %v, want ErrInvalidConfig naming %s", field, err, field)
		}
	}
}

// The Publisher parks a row whose topic cannot be a routing key, and
// retries every other failure.
func TestPublisherRefusesLongRoutingKeys(t *testing.T) {
	p := &Publisher{URL: "amqp://guest:guest@127.0.0.1:5672/"}
	err := p.Refuse(&kgo.Record{Topic: strings.Repeat("k", 256)})
	if !errors.Is(err, ErrBadRoutingKey) || !p.Permanent(err) {
		t.Errorf("a 256-byte topic: %v, permanent %v; want ErrBadRoutingKey, permanent", err, p.Permanent(err))
	}
	if err := p.Refuse(&kgo.Record{Topic: strings.Repeat("k", 255)}); err != nil {
		t.Errorf("a 255-byte topic: %v", err)
	}
	if p.Permanent(ErrUnroutable) || p.Permanent(ErrNotConfirmed) {
		t.Error("an unroutable or unconfirmed publish is permanent; it should be retried")
	}
}
