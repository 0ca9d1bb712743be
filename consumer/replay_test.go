package consumer

import (
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"
)

// A probe replays the dead owner's window only in batch mode, when it fits
// in one of this consumer's batches, or with key parallelism, when it fits
// in this consumer's buffer; and when the death cannot be a
// record's doing that a strict probe must find: the dead owner was not
// probing or replaying, and no death is counted against a record still to
// run; and without a KeyFunc, so that the inbox can say where the window
// begins.
func TestReplays(t *testing.T) {
	batch := func(size, lanes int) *Consumer {
		return &Consumer{cfg: Config{BatchSize: size, KeyParallelism: lanes, MaxBufferedRecords: 2000}}
	}
	died := ownership{deaths: 1, suspect: -1, inFlight: 100}
	for _, tc := range []struct {
		name string
		c    *Consumer
		o    ownership
		want bool
	}{
		{"batch mode, an ordinary batch in flight", batch(100, 0), died, true},
		{"a smaller batch in flight", batch(100, 0), ownership{deaths: 1, suspect: -1, inFlight: 10}, true},
		{"record mode", batch(1, 0), died, false},
		{"key parallelism, a buffer in flight", batch(0, 8), ownership{deaths: 1, suspect: -1, inFlight: 2000}, true},
		{"key parallelism, a bigger buffer than this consumer's", batch(0, 8), ownership{deaths: 1, suspect: -1, inFlight: 4000}, false},
		{"key parallelism after a batch owner", batch(0, 8), died, true},
		{"a bigger batch than this consumer's", batch(50, 0), died, false},
		{"one record in flight", batch(100, 0), ownership{deaths: 1, suspect: -1, inFlight: 1}, false},
		{"in flight unknown", batch(100, 0), ownership{deaths: 1, suspect: -1}, false},
		{"died probing or replaying", batch(100, 0), ownership{deaths: 2, suspect: -1, inFlight: 100, strict: true}, false},
		{"a suspect still to run", batch(100, 0), ownership{deaths: 2, suspect: 7, kills: 1, inFlight: 100}, false},
		{"a KeyFunc (no asking the inbox which records finished)", &Consumer{cfg: Config{BatchSize: 100, MaxBufferedRecords: 2000,
			KeyFunc: func(*kgo.Record) (string, error) { return "", nil }}}, died, false},
	} {
		if got := tc.c.replays(tc.o); got != tc.want {
			t.Errorf("%s: replays = %v, want %v", tc.name, got, tc.want)
		}
	}
}
