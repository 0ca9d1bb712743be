package rabbitconsumer

import (
	"context"
	"errors"
	"runtime"
	"slices"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/internal/testhook"
)

// consumeBatches runs queue's deliveries in batches (Config.BatchSize),
// each in a place of Concurrency, until the deliveries end. A batch waits
// for its place, then takes every delivery that is there, up to
// BatchSize: it never waits for more, so a message that arrives alone
// runs at once, and deliveries that arrive while every place is busy make
// up the next batches.
func (s *session) consumeBatches(queue string, deliveries <-chan amqp.Delivery) {
	r := s.r
	n := r.c.cfg.BatchSize
	// The client hands deliveries over one at a time; ready holds those
	// that arrived while the batches were busy, to be taken at once.
	ready := make(chan amqp.Delivery, r.c.cfg.Prefetch)
	go func() {
		defer close(ready)
		for d := range deliveries {
			s.acks.delivered(d.DeliveryTag)
			ready <- d
		}
	}()
	slots := r.slots[queue]
	for d := range ready {
		select {
		case slots <- struct{}{}:
		case <-s.lost:
			continue // unacknowledged: it comes again on the next connection
		case <-r.ctx.Done():
			continue
		}
		batch := []amqp.Delivery{d}
		// One yield, when ready runs dry, lets the client's goroutines
		// hand over the deliveries already read from the connection.
		for yielded := false; len(batch) < n; {
			select {
			case d, ok := <-ready:
				if ok {
					batch = append(batch, d)
					continue
				}
			default:
				if !yielded {
					yielded = true
					runtime.Gosched()
					continue
				}
			}
			break // ready ran dry, or ended
		}
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			defer func() { <-slots }()
			s.handleBatch(queue, batch)
		}()
	}
}

// handleBatch runs a batch of deliveries through the record path's batch
// mode (consumer.DeliverBatch): one transaction, a savepoint per message
// (or one BatchHandler call); the batch's messages are acknowledged
// together after the COMMIT.
func (s *session) handleBatch(queue string, ds []amqp.Delivery) {
	b := &batchAcks{s: s}
	recs := make([]*kgo.Record, len(ds))
	srcs := make([]consumer.Source, len(ds))
	for i := range ds {
		src := s.source(queue, &ds[i])
		src.batch = b
		recs[i], srcs[i] = src.rec, src
	}
	s.r.c.path.DeliverBatch(s.r.workCtx, recs, srcs)
	b.flush()
	for _, src := range srcs {
		src.DatabaseDown(false)
	}
}

// batchAcks collects the delivery tags of a batch's settled messages, to
// acknowledge them together: at the end of the batch, or before one of its
// messages waits for anything (a retry's copy, a dead letter, a backoff),
// so that no settled message waits for another's failure. DeliverBatch
// runs a batch's messages in one goroutine: no lock.
type batchAcks struct {
	s    *session
	tags []uint64
}

// settled adds src's delivery to the batch's acknowledgement.
func (b *batchAcks) settled(src *source) { b.tags = append(b.tags, src.d.DeliveryTag) }

// flush acknowledges the deliveries settled so far; nothing after a
// simulated crash (a test's crash point). A nil batchAcks (no batch) has
// nothing to flush.
func (b *batchAcks) flush() {
	if b == nil || len(b.tags) == 0 {
		return
	}
	tags := b.tags
	b.tags = nil
	r := b.s.r
	if errors.Is(context.Cause(r.ctx), testhook.ErrCrash) {
		return
	}
	if err := b.s.acks.ack(tags...); err != nil {
		r.c.cfg.Logger.Warn("oncely rabbitmq batch ack failed; its messages come again and are skipped as duplicates",
			"messages", len(tags), "first_delivery_tag", tags[0], "err", err)
	}
}

// acker acknowledges the deliveries of one channel. Tracked, it knows
// which deliveries are unacknowledged, in delivery-tag order, and
// acknowledges a batch with one basic.ack of its highest tag (multiple)
// when no other delivery below it is unacknowledged: a multiple ack would
// settle those too, among them messages still running or abandoned. Only
// a channel whose deliveries are recorded in tag order (one consumer,
// read by one goroutine) can be tracked.
type acker struct {
	ch      acknowledger
	tracked bool

	mu      sync.Mutex
	unacked []uint64 // tracked: the deliveries not acknowledged, ascending
}

// delivered records a delivery, in delivery-tag order.
func (a *acker) delivered(tag uint64) {
	if !a.tracked {
		return
	}
	a.mu.Lock()
	a.unacked = append(a.unacked, tag)
	a.mu.Unlock()
}

// ack acknowledges the deliveries tags: all of them with one multiple ack
// of the highest when no other unacknowledged delivery lies below it, else
// one by one.
func (a *acker) ack(tags ...uint64) error {
	if !a.tracked {
		return ackEach(a.ch, tags)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	high := slices.Max(tags)
	// tags are unacknowledged deliveries: exactly they lie at or below
	// high when that many do.
	below, _ := slices.BinarySearch(a.unacked, high+1)
	if len(tags) > 1 && below == len(tags) {
		if err := a.ch.Ack(high, true); err != nil {
			return err
		}
		a.unacked = a.unacked[below:]
		return nil
	}
	for _, t := range tags {
		if i, found := slices.BinarySearch(a.unacked, t); found {
			a.unacked = slices.Delete(a.unacked, i, i+1)
		}
	}
	return ackEach(a.ch, tags)
}

// acknowledger sends basic.ack: an *amqp.Channel.
type acknowledger interface {
	Ack(tag uint64, multiple bool) error
}

// ackEach acknowledges each of tags on ch.
func ackEach(ch acknowledger, tags []uint64) error {
	for _, t := range tags {
		if err := ch.Ack(t, false); err != nil {
			return err
		}
	}
	return nil
}
