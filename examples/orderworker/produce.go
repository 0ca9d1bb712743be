package main

import (
	"cmp"
	"context"
	cryptorand "crypto/rand"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
)

// orderSpec describes a batch of random orders.
type orderSpec struct {
	Count      int     // distinct orders
	Customers  int     // customers the orders are spread over
	DupRate    float64 // fraction of records delivered a second time
	PoisonRate float64 // poison records mixed in, as a fraction of Count
}

// validate names the produce command's flag of the first invalid field.
func (s orderSpec) validate() (flagName string, err error) {
	switch {
	case s.Count < 1:
		return "--count", fmt.Errorf("must be at least 1, got %d", s.Count)
	case s.Customers < 1:
		return "--customers", fmt.Errorf("must be at least 1, got %d", s.Customers)
	case !(s.DupRate >= 0 && s.DupRate <= 1):
		return "--dup-rate", fmt.Errorf("must be between 0 and 1, got %v", s.DupRate)
	case !(s.PoisonRate >= 0 && s.PoisonRate <= 1):
		return "--poison-rate", fmt.Errorf("must be between 0 and 1, got %v", s.PoisonRate)
	}
	return "", nil
}

// delivery is one record to produce.
type delivery struct {
	Order     Order
	Poison    []byte // the value of a record that is not a valid order; nil for an order
	MessageID string // the record's message-id header: the inbox's dedup key
	Duplicate bool   // a second delivery of a record produced before
	// byCustomer keys the record by its customer, not its order id.
	byCustomer bool

	// Set by the history check, which reads deliveries back from Kafka.
	At    string      // where it was read: topic/partition/offset
	Class dlq.Class   // a poison record's dead-letter class: undecodable or permanent
	rawID string      // its message-id header, which the dedup id is unless Postgres text cannot hold it
	src   *kgo.Record // the record itself
}

// orderBatch is what a producer sent: each order once, the message ids of
// the poison records (records that are not valid orders), and the
// deliveries (duplicates included) in the order they went to Kafka.
type orderBatch struct {
	Orders     []Order
	Poison     []string
	Deliveries []delivery
	Duplicates int

	// Set by the history check.
	Aborted         []delivery // records of aborted Kafka transactions, which no consumer may see
	Transactional   int        // deliveries from committed Kafka transactions
	Unstorable      int        // poison records whose message id Postgres text cannot hold
	NearLimitOrders int        // orders within nearLimit bytes of the topic's max.message.bytes
	NearLimitPoison int        // poison records as close to it
}

// balances is what customer_balances must hold once every order of the
// batch counted exactly once.
func (b orderBatch) balances() map[string]int64 {
	m := make(map[string]int64)
	for _, o := range b.Orders {
		m[o.CustomerID] += o.AmountCents
	}
	return m
}

func (b orderBatch) totalCents() int64 {
	var sum int64
	for _, o := range b.Orders {
		sum += o.AmountCents
	}
	return sum
}

func newRand() *rand.Rand { return rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64())) }

// poisonValues are the kinds of poison record generate mixes in; %d is the
// record's number. The first three fail to decode (class undecodable), the
// others fail validation (class permanent).
var poisonValues = []string{
	`not json %d`,
	`{"order_id": %d}`,
	`{"order_id":"poison-%d","customer_id":"cust-x","amount_cents":100,"coupon":"FREE"}`,
	`{"customer_id":"cust-x","amount_cents":%d}`,
	`{"order_id":"poison-%d","customer_id":"cust-x","amount_cents":0}`,
	`{"order_id":"poison-%d","customer_id":"cust-x","amount_cents":-500}`,
}

// generate makes spec.Count random orders and round(PoisonRate*Count)
// poison records, each with its own message id, spread over the stream,
// and delivers round(DupRate*(orders+poison)) of them a second time, with
// the same message id, somewhat later in the stream: the duplicate a
// producer sends when it retries after a timeout, or when an outbox relay
// crashes after publishing and before marking the row sent. Message ids
// and order ids are random; everything else follows rng.
func generate(spec orderSpec, rng *rand.Rand) orderBatch {
	// A random prefix keeps order ids unique across produce runs.
	run := strings.ToLower(cryptorand.Text()[:6])
	type keyed struct {
		at float64 // position in the stream
		d  delivery
	}
	var stream []keyed
	b := orderBatch{Orders: make([]Order, spec.Count)}
	for i := range spec.Count {
		o := Order{
			OrderID:     fmt.Sprintf("ord-%s-%05d", run, i),
			CustomerID:  fmt.Sprintf("cust-%03d", rng.IntN(spec.Customers)),
			AmountCents: 100 + rng.Int64N(99_901), // $1.00 to $1,000.00
		}
		b.Orders[i] = o
		stream = append(stream, keyed{float64(i), delivery{Order: o, MessageID: cryptorand.Text()}})
	}
	for i := range int(math.Round(spec.PoisonRate * float64(spec.Count))) {
		// Keyed like an order, so that it lands amid a customer's orders.
		d := delivery{
			Order:     Order{CustomerID: fmt.Sprintf("cust-%03d", rng.IntN(spec.Customers))},
			Poison:    fmt.Appendf(nil, poisonValues[i%len(poisonValues)], i),
			MessageID: cryptorand.Text(),
		}
		b.Poison = append(b.Poison, d.MessageID)
		stream = append(stream, keyed{rng.Float64() * float64(spec.Count), d})
	}
	b.Duplicates = int(math.Round(spec.DupRate * float64(len(stream))))
	for _, i := range rng.Perm(len(stream))[:b.Duplicates] {
		d := stream[i].d
		d.Duplicate = true
		// Up to ~300 records later: usually after the original was
		// processed, sometimes while it is still in flight.
		stream = append(stream, keyed{stream[i].at + 0.5 + float64(rng.IntN(300)), d})
	}
	slices.SortStableFunc(stream, func(a, b keyed) int { return cmp.Compare(a.at, b.at) })
	for _, k := range stream {
		b.Deliveries = append(b.Deliveries, k.d)
	}
	return b
}

// KeyByCustomer keys every delivery by its customer instead of its order:
// one customer's orders then stay in one partition.
func (b *orderBatch) KeyByCustomer() {
	for i := range b.Deliveries {
		b.Deliveries[i].byCustomer = true
	}
}

// record turns a delivery into a Kafka record. The key is the order id, as
// on most real topics: one customer's orders spread over every partition,
// and the handlers of several partitions and members update the same
// balance row (the consumer's conflict keys make them take turns). A
// duplicate lands in the same partition as its original, though the inbox
// does not depend on that: it dedups by message id across partitions.
// Poison records are keyed by their message id.
func (d delivery) record(topic string) *kgo.Record {
	value := d.Poison
	if value == nil {
		value, _ = json.Marshal(d.Order) // cannot fail: strings and an int
	}
	key := d.Order.OrderID
	switch {
	case d.byCustomer:
		key = d.Order.CustomerID
	case key == "":
		key = d.MessageID
	}
	return &kgo.Record{
		Topic:   topic,
		Key:     []byte(key),
		Value:   value,
		Headers: []kgo.RecordHeader{{Key: consumer.DefaultMessageIDHeader, Value: []byte(d.MessageID)}},
	}
}

// produce sends ds in order, perSecond records a second (0: as fast as
// possible), each acknowledged by all in-sync replicas (franz-go's
// default).
func produce(ctx context.Context, cl *kgo.Client, topic string, ds []delivery, perSecond int) error {
	return pace(ctx, ds, perSecond, func(ctx context.Context, chunk []delivery) error {
		recs := make([]*kgo.Record, len(chunk))
		for i, d := range chunk {
			recs[i] = d.record(topic)
		}
		if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
			return fmt.Errorf("produce to %s: %w", topic, err)
		}
		return nil
	})
}

// pace calls send with ds in order, in chunks, perSecond records a second
// (0: chunks of 500 as fast as possible), until send's first error.
func pace(ctx context.Context, ds []delivery, perSecond int, send func(context.Context, []delivery) error) error {
	chunk, tick := 500, time.Duration(0)
	if perSecond > 0 {
		// 20 small bursts a second approximate a steady stream.
		chunk, tick = max(1, perSecond/20), 50*time.Millisecond
	}
	var t *time.Ticker
	if tick > 0 {
		t = time.NewTicker(tick)
		defer t.Stop()
	}
	for len(ds) > 0 {
		n := min(chunk, len(ds))
		if err := send(ctx, ds[:n]); err != nil {
			return err
		}
		ds = ds[n:]
		if t != nil && len(ds) > 0 {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-t.C:
			}
		}
	}
	return nil
}

// publishOpts are the produce command's pace and retries on JetStream and
// RabbitMQ.
type publishOpts struct {
	PerSecond int           // records a second; 0: as fast as possible
	RetryFor  time.Duration // how long to publish a message again after a failure; 0: fail at once
}

// Backoff between the publishes of one message after a failure.
const (
	retryBackoffMin = 100 * time.Millisecond
	retryBackoffMax = 2 * time.Second
)

// publishEach publishes ds with publish, one after the other, paced by
// o.PerSecond. A message whose publish fails (the broker restarting, the
// connection lost) is published again, under the same message id, until it
// is acknowledged or o.RetryFor has passed since its first failure: as a
// producer retries after a timeout, whether or not the broker stored the
// first copy, which the worker's inbox then deduplicates. It returns how
// many publishes were such repeats.
func publishEach(ctx context.Context, ds []delivery, o publishOpts, publish func(context.Context, delivery) error) (repeated int, err error) {
	err = pace(ctx, ds, o.PerSecond, func(ctx context.Context, chunk []delivery) error {
		for _, d := range chunk {
			var failedAt time.Time
			backoff := retryBackoffMin
			for {
				err := publish(ctx, d)
				if err == nil {
					break
				}
				if failedAt.IsZero() {
					failedAt = time.Now()
				}
				if ctx.Err() != nil || time.Since(failedAt) >= o.RetryFor {
					return err
				}
				repeated++
				select {
				case <-ctx.Done():
					return err
				case <-time.After(backoff):
				}
				backoff = min(2*backoff, retryBackoffMax)
			}
		}
		return nil
	})
	return repeated, err
}
