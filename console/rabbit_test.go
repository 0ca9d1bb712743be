package console

import (
	"crypto/sha256"
	"slices"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/rabbitconsumer"
)

// A RabbitMQ dead letter keeps its number from listing to listing,
// whatever its position and its queue's delivery counts; a new one gets a
// number above every number given before; identical messages are told
// apart by their order; a message gone comes back with a new number only
// once its number is forgotten.
func TestRabbitNumbersFollowTheMessages(t *testing.T) {
	q := &rabbitQueue{seen: map[[sha256.Size]byte]*seenMessage{}}
	msg := func(body string, deliveries string) dlq.Entry {
		return dlq.Entry{Record: &kgo.Record{Value: []byte(body), Headers: []kgo.RecordHeader{
			{Key: dlq.HeaderMessageID, Value: []byte(body)},
			{Key: rabbitconsumer.DeliveryCountHeader, Value: []byte(deliveries)},
		}}, Copies: 1}
	}
	listing := func(es ...dlq.Entry) []int64 { return q.number(es) }

	if got := listing(msg("a", "1"), msg("b", "1"), msg("same", "1"), msg("same", "1"), msg("c", "1")); !slices.Equal(got, []int64{0, 1, 2, 3, 4}) {
		t.Fatalf("first listing: %v, want 0 to 4", got)
	}
	// b gone (redriven), the delivery counts up, d new and first.
	if got := listing(msg("d", "1"), msg("a", "2"), msg("same", "2"), msg("same", "2"), msg("c", "2")); !slices.Equal(got, []int64{5, 0, 2, 3, 4}) {
		t.Fatalf("second listing: %v, want d 5 and the others their numbers", got)
	}
	// One of the identical two gone: the first keeps its number.
	if got := listing(msg("a", "3"), msg("same", "3"), msg("c", "3"), msg("d", "2")); !slices.Equal(got, []int64{0, 2, 4, 5}) {
		t.Fatalf("third listing: %v, want 0 2 4 5", got)
	}
	// Another body, header or header value is another message.
	other := msg("a", "3")
	other.Record.Headers = append(other.Record.Headers, kgo.RecordHeader{Key: dlq.HeaderLastFailure, Value: []byte("later")})
	if got := listing(other); got[0] <= 5 {
		t.Errorf("a dead letter of a later failure numbered %d, want a new number", got[0])
	}
	if messageHash(msg("a", "1").Record) != messageHash(msg("a", "9").Record) {
		t.Error("the delivery count changes the hash")
	}
}
