package rabbitconsumer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/brokersource"
)

// ListIdleTimeout bounds the wait for the next message of a listing that
// has not yet received as many messages as the dead-letter queue held when
// it started (some were taken or expired meanwhile): the listing ends with
// what it has, unless the queue still has messages ready, which RabbitMQ
// is slow to hand over (a quorum queue still putting back the tens of
// thousands of messages of a listing just closed): then it waits again,
// up to listIdleRounds times.
const ListIdleTimeout = 3 * time.Second

// listIdleRounds bounds the waits of ListIdleTimeout of one listing while
// its queue has messages ready that do not come (another consumer of a
// single-active-consumer queue gets them).
const listIdleRounds = 10

// maxPrefetch is the largest prefetch count AMQP can express (a short).
const maxPrefetch = 65535

// DeadLetterQueue is a listing of a dead-letter queue (of a Consumer's
// dead letters) that holds its messages: the tools of package dlq, and
// `oncely dlq --queue`, on RabbitMQ. A queue is not a log, and RabbitMQ
// cannot show a message without delivering it, so the listing is a
// consumer on a channel of its own that takes every message the queue held
// when it started, unacknowledged, and holds them until Close, which gives
// back (requeues) those not redriven, unchanged. Redrive removes (acks) the
// messages it redrove, on the same channel. See the package doc, "Dead
// letters", for what a listing changes and what its refs mean.
//
// Open one with OpenDeadLetters; Entries lists, Redrive redrives, Close
// ends. Its methods are safe for concurrent use.
type DeadLetterQueue struct {
	queue string
	conn  *amqp.Connection
	ch    *amqp.Channel // the listing's: holds the messages until acked or closed
	pub   *confirmer

	mu      sync.Mutex
	read    bool // the listing was read (recs, or readErr)
	recs    []*kgo.Record
	readErr error
	removed map[*amqp.Delivery]bool // acked: no longer in the queue
}

// OpenDeadLetters connects to RabbitMQ at url (its own connection, named
// "oncely dlq") to list and redrive the dead-letter queue queue, which
// must exist. Close it: until then the messages listed are held.
func OpenDeadLetters(ctx context.Context, url, queue string) (*DeadLetterQueue, error) {
	if queue == "" {
		return nil, errors.New("rabbitconsumer: dead-letter queue: the queue name is required")
	}
	conn, err := dial(ctx, url, nil, "oncely dlq "+queue)
	if err != nil {
		return nil, err
	}
	q := &DeadLetterQueue{queue: queue, conn: conn, removed: map[*amqp.Delivery]bool{}}
	if q.ch, err = conn.Channel(); err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("rabbitconsumer: dead-letter queue %q: open channel: %w", queue, err)
	}
	if q.pub, err = newConfirmer(conn); err != nil {
		_ = conn.Close()
		return nil, err
	}
	return q, nil
}

// Close gives every message listed and not redriven back to the
// dead-letter queue (closing the listing's channel requeues them) and
// closes the connection.
func (q *DeadLetterQueue) Close() error {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.conn.Close()
}

// Entries reads the dead-letter queue at its first call (the listing; later
// calls select from the same listing) and returns the entries that match f,
// as dlq.Entries does: copies of one dead-lettering listed once, and with
// f.RefuseInvalid, an *dlq.InvalidRecordError for the first message that
// is not a dead letter, at which the read stops (a source queue named by
// mistake is not taken in whole; Close gives back what was taken).
//
// An entry's Record is its dead-letter message (rabbitconsumer's record of
// the delivery: Value the body, the AMQP headers as record headers), with
// Topic the dead-letter queue, Partition 0 and Offset its position in the
// listing from 0, so its Ref is queue/0/position and f.Refs may name it as
// 0/position. Positions are the listing's: they name the same messages in
// a later listing only while nothing was added to or removed from the
// queue in between.
func (q *DeadLetterQueue) Entries(ctx context.Context, f dlq.Filter) ([]dlq.Entry, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if !q.read {
		q.recs, q.readErr = q.list(ctx, f.RefuseInvalid)
		q.read = true
	}
	if q.readErr != nil {
		return nil, q.readErr
	}
	var recs []*kgo.Record
	for _, r := range q.recs {
		if d, _ := deliveryOf(r); !q.removed[d] {
			recs = append(recs, r)
		}
	}
	return dlq.Entries(recs, f)
}

// list takes the messages the queue holds: the first with basic.get (a
// queue that is not a dead-letter queue is refused having given out one
// message), the others through consumers whose prefetches add up to their
// number, so that RabbitMQ hands over no more than were there at the
// start, until it has them all or none comes for ListIdleTimeout (see
// there). A prefetch counts at most maxPrefetch messages, so a queue of
// more has a consumer for each maxPrefetch of them, on the same channel
// (an unlimited prefetch would not do: a quorum queue hands a consumer
// without a limit 2,000 unacknowledged messages, then waits for acks); the
// order of such a listing is the queue's within each consumer's share,
// the shares interleaved. The consumers are then cancelled; the messages
// stay unacknowledged on the channel.
func (q *DeadLetterQueue) list(ctx context.Context, refuse bool) ([]*kgo.Record, error) {
	n, err := q.count()
	if err != nil || n == 0 {
		return nil, err
	}
	first, ok, err := q.ch.Get(q.queue, false)
	if err != nil {
		return nil, fmt.Errorf("rabbitconsumer: read dead-letter queue %q: %w", q.queue, err)
	}
	if !ok {
		return nil, nil // emptied meanwhile
	}
	var recs []*kgo.Record
	take := func(d *amqp.Delivery) error {
		rec := record(q.queue, d)
		rec.Offset = int64(len(recs))
		recs = append(recs, rec)
		if refuse {
			if _, err := dlq.Decode(rec.Headers); err != nil {
				return &dlq.InvalidRecordError{Ref: fmt.Sprintf("%s/%d/%d", rec.Topic, rec.Partition, rec.Offset), Err: err}
			}
		}
		return nil
	}
	if err := take(&first); err != nil || n == 1 {
		return recs, err
	}
	// Every consumer's deliveries into one channel, in the order each
	// consumer receives them.
	deliveries := make(chan amqp.Delivery)
	stop := make(chan struct{})
	gone := make(chan struct{}, (n-1)/maxPrefetch+1) // a consumer's deliveries ended: cancelled, or the channel closed
	var wg sync.WaitGroup
	defer func() { close(stop); wg.Wait() }()
	for i, left := 0, n-1; left > 0; i++ {
		prefetch := min(left, maxPrefetch)
		left -= prefetch
		if err := q.ch.Qos(prefetch, 0, false); err != nil {
			return nil, fmt.Errorf("rabbitconsumer: read dead-letter queue %q: basic.qos %d: %w", q.queue, prefetch, err)
		}
		tag := fmt.Sprintf("oncely-dlq-list-%d", i)
		ds, err := q.ch.Consume(q.queue, tag, false, false, false, false, nil)
		if err != nil {
			return nil, fmt.Errorf("rabbitconsumer: read dead-letter queue %q: %w", q.queue, err)
		}
		// Cancelling leaves the messages unacknowledged on the channel:
		// Redrive acks some, Close gives back the rest; a message that came
		// after the last one listed is given back with them.
		defer func() { _ = q.ch.Cancel(tag, false) }()
		wg.Go(func() {
			for d := range ds {
				select {
				case deliveries <- d:
				case <-stop: // the listing ended: what still comes is given back on Close
				}
			}
			gone <- struct{}{}
		})
	}
	idle := time.NewTimer(ListIdleTimeout)
	defer idle.Stop()
	for rounds := 0; len(recs) < n; {
		select {
		case d := <-deliveries:
			if err := take(&d); err != nil {
				return recs, err
			}
			idle.Reset(ListIdleTimeout)
		case <-gone:
			return nil, fmt.Errorf("rabbitconsumer: read dead-letter queue %q: the channel closed", q.queue)
		case <-idle.C:
			// None came for ListIdleTimeout: fewer than counted, taken or
			// expired meanwhile, unless the queue still has some ready.
			rounds++
			if ready, err := q.count(); err != nil || ready == 0 || rounds == listIdleRounds {
				return recs, nil
			}
			idle.Reset(ListIdleTimeout)
		case <-ctx.Done():
			return nil, fmt.Errorf("rabbitconsumer: read dead-letter queue %q: %w", q.queue, ctx.Err())
		}
	}
	return recs, nil
}

// count is the number of messages ready in the queue, from a passive
// declaration on a channel of its own (a failed one closes its channel).
func (q *DeadLetterQueue) count() (int, error) {
	ch, err := q.conn.Channel()
	if err != nil {
		return 0, fmt.Errorf("rabbitconsumer: dead-letter queue %q: open channel: %w", q.queue, err)
	}
	defer func() { _ = ch.Close() }()
	st, err := ch.QueueDeclarePassive(q.queue, true, false, false, false, nil)
	if ae := (*amqp.Error)(nil); errors.As(err, &ae) && ae.Code == amqp.NotFound {
		return 0, fmt.Errorf("rabbitconsumer: dead-letter queue %q does not exist: %w", q.queue, err)
	}
	if err != nil {
		return 0, fmt.Errorf("rabbitconsumer: dead-letter queue %q: %w", q.queue, err)
	}
	return st.Messages, nil
}

// Redrive publishes entries (of Entries) back to their source queues (or
// to the queue opts.ToTopic) as dlq.RedriveWith does: each after recording
// its redrive grant in opts.Inbox, through the default exchange with the
// source queue as the routing key, mandatory and persistent, waiting for
// the publisher confirmation. The copy is the dead letter's body and
// properties, its message_id the dedup id, its headers those of the
// message without the oncely-dlq-* ones and the queue's delivery counts,
// plus the dedup id in opts.IDHeader and dlq.HeaderRedrive (the entry's
// Ref). Once confirmed, the dead letter is removed from the queue (acked),
// with its copies (Entry.Copies); a dry run publishes and removes nothing,
// and a message the inbox holds as processed (dlq.SkipProcessed) stays. A
// result's Offset is -1: a queue gives a message no position.
//
// A removal that fails (the channel closed) is reported after the others,
// joined to the error: the message was redriven but stays in the
// dead-letter queue, and a later redrive of it is skipped once the copy
// ran (the grant lets one copy run, once).
func (q *DeadLetterQueue) Redrive(ctx context.Context, entries []dlq.Entry, opts dlq.RedriveOptions) ([]dlq.Result, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	byRef := make(map[string]*dlq.Entry, len(entries))
	for i := range entries {
		e := &entries[i]
		if d, ok := deliveryOf(e.Record); !ok || e.Record.Topic != q.queue || q.removed[d] || !q.holds(d) {
			return nil, fmt.Errorf("rabbitconsumer: redrive %s: not a message of this listing of %q", e.Ref(), q.queue)
		}
		byRef[e.Ref()] = e
	}
	var unremoved []error
	results, err := dlq.RedriveWith(ctx, func(ctx context.Context, rec *kgo.Record) error {
		ref, _ := header(rec, dlq.HeaderRedrive)
		e := byRef[ref]
		if e == nil {
			return fmt.Errorf("rabbitconsumer: redrive: no entry %q", ref)
		}
		d, _ := deliveryOf(e.Record)
		headers := table(rec, d.Headers)
		delete(headers, DeliveryCountHeader) // the dead-letter queue's count, not the source queue's
		delete(headers, AcquiredCountHeader)
		msg := publishing(d, headers)
		msg.MessageId = e.Info.MessageID // read first by the consumer
		pctx, cancel := context.WithTimeout(ctx, brokersource.PublishTimeout)
		defer cancel()
		if err := q.pub.publish(pctx, "", rec.Topic, msg); err != nil {
			return err
		}
		rec.Partition, rec.Offset = 0, -1
		for _, c := range q.copies(e) {
			if err := c.Ack(false); err != nil {
				unremoved = append(unremoved, fmt.Errorf("rabbitconsumer: %s was redriven but stays in %q: ack: %w", e.Ref(), q.queue, err))
				continue
			}
			q.removed[c] = true
		}
		return nil
	}, entries, opts)
	return results, errors.Join(append([]error{err}, unremoved...)...)
}

// holds reports whether d is a message of the listing.
func (q *DeadLetterQueue) holds(d *amqp.Delivery) bool {
	for _, r := range q.recs {
		if x, _ := deliveryOf(r); x == d {
			return true
		}
	}
	return false
}

// copies returns the deliveries of e's dead-lettering still held: e's own
// and those of the messages with the same group, dedup id and source
// (Entry.Copies). A source's Offset is a delivery tag, which a channel
// numbers afresh: two dead-letterings of one id from one queue may look
// like copies. Both are dead letters of the message the redrive runs once
// more, and both are removed.
func (q *DeadLetterQueue) copies(e *dlq.Entry) []*amqp.Delivery {
	var out []*amqp.Delivery
	for _, r := range q.recs {
		d, _ := deliveryOf(r)
		if q.removed[d] {
			continue
		}
		if r == e.Record {
			out = append(out, d)
			continue
		}
		if i, err := dlq.Decode(r.Headers); err == nil && i.Group == e.Info.Group && i.MessageID == e.Info.MessageID &&
			i.Topic == e.Info.Topic && i.Partition == e.Info.Partition && i.Offset == e.Info.Offset {
			out = append(out, d)
		}
	}
	return out
}

// header returns the value of rec's header key.
func header(rec *kgo.Record, key string) (string, bool) {
	for _, h := range rec.Headers {
		if h.Key == key {
			return string(h.Value), true
		}
	}
	return "", false
}
