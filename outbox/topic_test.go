package outbox_test

import (
	"strings"
	"testing"

	"github.com/oncely/oncely/outbox"
)

// ValidateTopic follows Kafka's rule for topic names, which brokers enforce:
// 1 to 249 of [a-zA-Z0-9._-], and not "." or "..".
func TestValidateTopic(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		topic string
		ok    bool
	}{
		{"orders", true}, {"a.b_c-D9", true}, {"...", true}, {strings.Repeat("t", 249), true},
		{"", false}, {".", false}, {"..", false}, {strings.Repeat("t", 250), false},
		{"bad topic", false}, {"café", false}, {"a/b", false}, {"a\x00b", false}, {"orders:v2", false},
	} {
		if err := outbox.ValidateTopic(tc.topic); (err == nil) != tc.ok {
			t.Errorf("ValidateTopic(%.20q) = %v, want ok %v", tc.topic, err, tc.ok)
		}
	}
}
