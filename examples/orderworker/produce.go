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
)

// orderSpec describes a batch of random orders.
type orderSpec struct {
	Count     int     // distinct orders
	Customers int     // customers the orders are spread over
	DupRate   float64 // fraction of orders delivered a second time
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
	}
	return "", nil
}

// delivery is one record to produce.
type delivery struct {
	Order     Order
	MessageID string // the record's message-id header: the inbox's dedup key
	Duplicate bool   // a second delivery of an order produced before
}

// orderBatch is what a producer sent: each order once, and the deliveries
// (duplicates included) in the order they went to Kafka.
type orderBatch struct {
	Orders     []Order
	Deliveries []delivery
	Duplicates int
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

// generate makes spec.Count random orders, each with its own message id, and
// delivers round(DupRate*Count) of them a second time, with the same message
// id, somewhat later in the stream: the duplicate a producer sends when it
// retries after a timeout, or when an outbox relay crashes after publishing
// and before marking the row sent.
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
	b.Duplicates = int(math.Round(spec.DupRate * float64(spec.Count)))
	for _, i := range rng.Perm(spec.Count)[:b.Duplicates] {
		d := stream[i].d
		d.Duplicate = true
		// Up to ~300 records later: usually after the original was
		// processed, sometimes while it is still in flight.
		stream = append(stream, keyed{float64(i) + 0.5 + float64(rng.IntN(300)), d})
	}
	slices.SortStableFunc(stream, func(a, b keyed) int { return cmp.Compare(a.at, b.at) })
	for _, k := range stream {
		b.Deliveries = append(b.Deliveries, k.d)
	}
	return b
}

// record turns a delivery into a Kafka record. The key is the customer, so
// one customer's orders stay in one partition and in order, and a duplicate
// usually lands in the same partition as its original, though the inbox does
// not depend on that: it dedups by message id across partitions.
func (d delivery) record(topic string) *kgo.Record {
	value, _ := json.Marshal(d.Order) // cannot fail: strings and an int
	return &kgo.Record{
		Topic:   topic,
		Key:     []byte(d.Order.CustomerID),
		Value:   value,
		Headers: []kgo.RecordHeader{{Key: consumer.DefaultMessageIDHeader, Value: []byte(d.MessageID)}},
	}
}

// produce sends ds in order, perSecond records a second (0: as fast as
// possible), each acknowledged by all in-sync replicas (franz-go's
// default).
func produce(ctx context.Context, cl *kgo.Client, topic string, ds []delivery, perSecond int) error {
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
		recs := make([]*kgo.Record, n)
		for i, d := range ds[:n] {
			recs[i] = d.record(topic)
		}
		if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
			return fmt.Errorf("produce to %s: %w", topic, err)
		}
		ds = ds[n:]
		if t != nil && len(ds) > 0 {
			select {
			case <-ctx.Done():
				return fmt.Errorf("produce to %s: %w", topic, ctx.Err())
			case <-t.C:
			}
		}
	}
	return nil
}
