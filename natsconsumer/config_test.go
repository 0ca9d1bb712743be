package natsconsumer

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Each invalid setting fails New with ErrInvalidConfig and the field's name.
func TestNewNamesTheInvalidField(t *testing.T) {
	var js jetstream.JetStream = struct{ jetstream.JetStream }{}
	for field, cfg := range map[string]Config{
		"JetStream":   {Stream: "S", Durable: "d"},
		"Stream":      {JetStream: js, Durable: "d"},
		"Durable":     {JetStream: js, Stream: "S", Durable: "a.b"},
		"Concurrency": {JetStream: js, Stream: "S", Durable: "d", Concurrency: -1},
		"AckWait":     {JetStream: js, Stream: "S", Durable: "d", AckWait: time.Millisecond},
		"Pool":        {JetStream: js, Stream: "S", Durable: "d"},
	} {
		_, err := New(cfg)
		if !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), field) {
			t.Errorf("%s: got %v, want ErrInvalidConfig naming %s", field, err, field)
		}
	}
}
