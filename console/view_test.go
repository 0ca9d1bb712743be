package console

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/dlq"
)

// chunkedSource is a place read in two chunks: the first at once, the
// second when release is closed.
type chunkedSource struct {
	kafkaSource
	t       *topicIndex
	release chan struct{}
	reads   int
}

func (c *chunkedSource) sync(ctx context.Context, _ string) (*topicIndex, error) {
	c.reads++
	if c.reads > 1 { // read whole: nothing new
		return c.t, nil
	}
	rec := func(o int64) *kgo.Record {
		return &kgo.Record{Topic: "t.dlq", Offset: o, Headers: (&dlq.Info{Topic: "t", Offset: o, Group: "g", MessageID: "m"}).Headers()}
	}
	c.t.add([]*kgo.Record{rec(0), rec(1)}, nil)
	select {
	case <-c.release:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	c.t.add([]*kgo.Record{rec(2)}, map[int32]int64{0: 3})
	return c.t, nil
}

// A view that the read of its place outlasts shows what was read so far,
// with a note; the read goes on in the background (one read, whatever the
// views), and a later view shows the place whole, without a note.
func TestViewIndexWithinBudget(t *testing.T) {
	src := &chunkedSource{t: &topicIndex{parts: map[int32]*partIndex{}, ids: map[idKey]*identity{}}, release: make(chan struct{})}
	count := func(ix *topicIndex) (n int) {
		ix.each(func(dlq.Entry) bool { n++; return true })
		return n
	}
	for range 2 {
		ix, note, err := viewIndex(t.Context(), src, src.t, "t.dlq", 20*time.Millisecond, time.Minute)
		if err != nil || !strings.Contains(note, "Still reading Kafka topic t.dlq") || !strings.Contains(note, "the 2 records read so far") {
			t.Fatalf("a view during the read: note %q, %v", note, err)
		}
		if n := count(ix); n != 2 {
			t.Fatalf("a view during the read shows %d records, want the 2 read", n)
		}
	}
	if src.reads != 1 {
		t.Errorf("%d reads for the views during one, want 1", src.reads)
	}
	close(src.release)
	ix, note, err := viewIndex(t.Context(), src, src.t, "t.dlq", 0, time.Minute)
	if err != nil || note != "" || count(ix) != 3 {
		t.Fatalf("a view after the read: %d records, note %q, %v; want 3 and none", count(ix), note, err)
	}
}
