//go:build linux

package integration_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testenv"
)

// The brokers' record size limits in the soak (max.message.bytes of each
// topic): the orders topic and its dead-letter topic take records up to
// 256 KiB, the events topic up to 16 KiB, so that an order can carry an
// event too large for the events topic.
const (
	soakMaxBytes       = 256 << 10
	soakEventsMaxBytes = 16 << 10
)

// The poison kinds the injector mixes into the orders topic during the
// chaos, besides the producer's invalid values; every one must be met
// during a run.
const (
	injectBinaryID   = "order under a raw 16-byte UUID message id (dead letter: undecodable)"
	injectNULID      = "order under a message id with a NUL byte (dead letter: undecodable)"
	injectNearOrder  = "order just under max.message.bytes (applied)"
	injectNearPoison = "poison just under max.message.bytes (dead letter: a stub)"
	injectTxn        = "transactions: aborted, then sent again and committed"
	injectBigEvent   = "order whose event is over the events topic's limit (parked)"
)

var soakInjectKinds = []string{injectBinaryID, injectNULID, injectNearOrder, injectNearPoison, injectTxn, injectBigEvent}

// soakInjected is what the injector sent, in the figures the check reads
// back: records a read-committed consumer sees, orders and poison records
// among them, and the kinds.
type soakInjected struct {
	records, orders, poison  int
	transactional, aborted   int
	unstorable               int
	nearOrders, nearPoison   int
	bigEvents                int
	rounds                   map[string]int // by kind
	done                     chan struct{}
	err                      error // the first produce that failed, once done
	plain, txn               *kgo.Client
	rng                      *rand.Rand
	topic                    string
	partitions               int32
	customers, injectedSoFar int
}

// soakOrder is an order as the orderworker reads it.
type soakOrder struct {
	OrderID     string `json:"order_id"`
	CustomerID  string `json:"customer_id"`
	AmountCents int64  `json:"amount_cents"`
}

// limitTopics sets max.message.bytes of the soak's topics.
func (s *soak) limitTopics(cl *kgo.Client) {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for topic, limit := range map[string]int{soakTopic: soakMaxBytes, dlq.DefaultTopic(soakTopic): soakMaxBytes, soakEvents: soakEventsMaxBytes} {
		v := fmt.Sprint(limit)
		resp, err := kadm.NewClient(cl).AlterTopicConfigs(ctx, []kadm.AlterConfig{{Name: "max.message.bytes", Value: &v}}, topic)
		if err == nil {
			err = resp[0].Err
		}
		if err != nil {
			s.t.Fatalf("set max.message.bytes of %s: %v", topic, err)
		}
	}
}

// startInjector mixes the poison kinds into the orders topic during the
// first 60% of the chaos (the producer runs for 85%): every kind once in a
// random order, then kinds at random, at least twice as many rounds as
// kinds and one every 4 s on average in longer runs. Its schedule and
// records follow the seed.
func (s *soak) startInjector(ctx context.Context) *soakInjected {
	s.t.Helper()
	in := &soakInjected{
		rounds: make(map[string]int), done: make(chan struct{}), rng: rand.New(rand.NewPCG(s.seed, 3)),
		topic: soakTopic, partitions: s.topics[0].partitions, customers: 40,
	}
	opts := []kgo.Opt{kgo.SeedBrokers(strings.Split(s.brokers, ",")...), kgo.RecordPartitioner(kgo.ManualPartitioner()),
		// Uncompressed: a record near the limit is that large on the wire.
		kgo.ProducerBatchCompression(kgo.NoCompression())}
	var err error
	if in.plain, err = kgo.NewClient(opts...); err != nil {
		s.t.Fatal(err)
	}
	if in.txn, err = kgo.NewClient(append(opts, kgo.TransactionalID(testenv.UniqueName("soak_tx")))...); err != nil {
		s.t.Fatal(err)
	}
	s.t.Cleanup(func() {
		<-in.done
		in.plain.Close()
		in.txn.Close()
	})
	rounds := max(2*len(soakInjectKinds), int(s.duration/(4*time.Second)))
	gap := time.Duration(float64(s.duration) * 0.6 / float64(rounds))
	kinds := slices.Clone(soakInjectKinds)
	in.rng.Shuffle(len(kinds), func(i, j int) { kinds[i], kinds[j] = kinds[j], kinds[i] })
	go func() {
		defer close(in.done)
		for n := 0; n < rounds && wait(ctx, between(in.rng, gap/2, gap*3/2)); n++ {
			kind := soakInjectKinds[in.rng.IntN(len(soakInjectKinds))]
			if n < len(kinds) {
				kind = kinds[n]
			}
			// Not cut short by the chaos's end: a transaction is always ended.
			if in.err = in.inject(s.t.Context(), kind); in.err != nil {
				in.err = fmt.Errorf("inject %s: %w", kind, in.err)
				return
			}
			in.rounds[kind]++
			s.note("injected %s", kind)
		}
	}()
	return in
}

// inject sends one round of kind.
func (in *soakInjected) inject(ctx context.Context, kind string) error {
	in.injectedSoFar++
	n := in.injectedSoFar
	p := in.rng.Int32N(in.partitions)
	switch kind {
	case injectBinaryID:
		var id [16]byte // a UUIDv7's layout, random bits
		for i := range id {
			id[i] = byte(in.rng.Uint32())
		}
		id[6], id[8] = id[6]&0x0f|0x70, id[8]&0x3f|0x80
		if utf8.Valid(id[:]) {
			id[15] = 0xff
		}
		in.poison++
		in.unstorable++
		return in.send(ctx, in.orderRecord(p, string(id[:]), in.order(n, "binary-id")))
	case injectNULID:
		in.poison++
		in.unstorable++
		return in.send(ctx, in.orderRecord(p, in.messageID()+"\x00"+in.messageID(), in.order(n, "nul-id")))
	case injectNearOrder:
		rec := in.orderRecord(p, in.messageID(), in.order(n, "near-limit"))
		rec.Value = append(bytes.Repeat([]byte(" "), nearLimitValue(rec)-len(rec.Value)), rec.Value...) // still JSON
		in.orders++
		in.nearOrders++
		return in.send(ctx, rec)
	case injectNearPoison:
		id := in.messageID()
		rec := &kgo.Record{Topic: in.topic, Partition: p, Key: []byte(id), Headers: messageIDHeader(id)}
		rec.Value = make([]byte, nearLimitValue(rec))
		for i := range rec.Value {
			rec.Value[i] = byte(in.rng.Uint32()) // incompressible
		}
		rec.Value[0] = 0xff // not JSON
		in.poison++
		in.nearPoison++
		return in.send(ctx, rec)
	case injectTxn:
		return in.transactions(ctx, n, p)
	case injectBigEvent:
		o := in.order(n, "big-event")
		var pad strings.Builder // random letters: the event stays over the limit however it is compressed
		for pad.Len() < 2*soakEventsMaxBytes {
			pad.WriteByte(byte('a' + in.rng.IntN(26)))
		}
		o.OrderID += "-" + pad.String()
		o.CustomerID = fmt.Sprintf("cust-big-%d", n) // a key of its own: no later event waits behind it
		in.orders++
		in.bigEvents++
		return in.send(ctx, in.orderRecord(p, in.messageID(), o))
	}
	return fmt.Errorf("unknown kind %q", kind)
}

// transactions sends two orders and a poison record in a transaction and
// aborts it, then sends the two orders again, under the same message ids,
// with a third in a transaction that commits: the aborted copies must never
// be applied, nor the poison record dead-lettered, and the committed ones
// must be applied once. A plain order follows in the partition, so that the
// group's committed offset can pass the transaction's marker.
func (in *soakInjected) transactions(ctx context.Context, n int, p int32) error {
	resent := []*kgo.Record{
		in.orderRecord(p, in.messageID(), in.order(n, "tx-a")),
		in.orderRecord(p, in.messageID(), in.order(n, "tx-b")),
	}
	poison := &kgo.Record{Topic: in.topic, Partition: p, Value: []byte("aborted poison"), Headers: messageIDHeader(in.messageID())}
	third := in.orderRecord(p, in.messageID(), in.order(n, "tx-c"))
	for _, commit := range []bool{false, true} {
		recs := append(slices.Clone(resent), poison)
		if commit {
			recs = append(slices.Clone(resent), third)
		}
		if err := in.txn.BeginTransaction(); err != nil {
			return err
		}
		for _, r := range recs {
			c := *r // a record is produced once
			if err := in.txn.ProduceSync(ctx, &c).FirstErr(); err != nil {
				_ = in.txn.EndTransaction(ctx, kgo.TryAbort)
				return err
			}
		}
		if err := in.txn.EndTransaction(ctx, kgo.TransactionEndTry(commit)); err != nil {
			return fmt.Errorf("end transaction (commit %v): %w", commit, err)
		}
		if commit {
			in.transactional += len(recs)
		} else {
			in.aborted += len(recs)
		}
	}
	in.orders += len(resent) + 1
	in.records += len(resent) + 1
	in.orders++
	return in.send(ctx, in.orderRecord(p, in.messageID(), in.order(n, "after-tx")))
}

// send produces rec alone (one record a batch: a record near the limit
// leaves no room for another).
func (in *soakInjected) send(ctx context.Context, rec *kgo.Record) error {
	in.records++
	return in.plain.ProduceSync(ctx, rec).FirstErr()
}

func (in *soakInjected) order(n int, what string) soakOrder {
	return soakOrder{
		OrderID:     fmt.Sprintf("inj-%05d-%s", n, what),
		CustomerID:  fmt.Sprintf("cust-%03d", in.rng.IntN(in.customers)),
		AmountCents: 100 + in.rng.Int64N(99_901),
	}
}

func (in *soakInjected) messageID() string {
	return fmt.Sprintf("%016x%016x", in.rng.Uint64(), in.rng.Uint64())
}

func (in *soakInjected) orderRecord(p int32, id string, o soakOrder) *kgo.Record {
	v, _ := json.Marshal(o) // cannot fail: strings and an int
	return &kgo.Record{Topic: in.topic, Partition: p, Key: []byte(o.CustomerID), Value: v, Headers: messageIDHeader(id)}
}

func messageIDHeader(id string) []kgo.RecordHeader {
	return []kgo.RecordHeader{{Key: "message-id", Value: []byte(id)}}
}

// nearLimitValue is the value length that leaves rec, alone in its record
// batch, 200 bytes under soakMaxBytes: its dead-letter copy, with oncely's
// headers, is over the limit.
func nearLimitValue(rec *kgo.Record) int {
	n := len(rec.Key)
	for _, h := range rec.Headers {
		n += len(h.Key) + len(h.Value)
	}
	return soakMaxBytes - 200 - n
}

// wait waits for the injector to finish its rounds (the chaos's end stops
// it) and fails the test if a produce failed.
func (in *soakInjected) wait(s *soak) {
	<-in.done
	if in.err != nil {
		s.t.Errorf("soak: %v", in.err)
	}
}
