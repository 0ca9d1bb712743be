package rabbitconsumer

import (
	"log/slog"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
)

// The attempts a delivery has spent are the larger of the quorum queue's
// two counts (RabbitMQ 4.3 counts failed returns in x-delivery-count and
// every delivery in x-acquired-count; earlier versions only the first,
// every return included); a classic queue's redelivery counts none.
func TestDeliveryCountTakesTheLargerCount(t *testing.T) {
	c := &Consumer{cfg: Config{Logger: slog.New(slog.DiscardHandler)}}
	for _, tc := range []struct {
		name    string
		headers amqp.Table
		want    int
	}{
		{"first delivery", nil, 0},
		{"x-delivery-count", amqp.Table{DeliveryCountHeader: int64(2)}, 2},
		{"both, acquired larger", amqp.Table{DeliveryCountHeader: int64(0), AcquiredCountHeader: int64(3)}, 3},
		{"both, delivery larger", amqp.Table{DeliveryCountHeader: int32(4), AcquiredCountHeader: int64(1)}, 4},
		{"classic queue", amqp.Table{"other": "x"}, 0},
	} {
		src := &source{s: &session{r: &run{c: c}}, d: &amqp.Delivery{Headers: tc.headers, Redelivered: tc.want > 0}, queue: "q"}
		if got := src.deliveryCount(); got != tc.want {
			t.Errorf("%s: %d, want %d", tc.name, got, tc.want)
		}
	}
}
