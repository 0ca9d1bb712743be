package rabbitconsumer

import (
	"context"
	"errors"
	"fmt"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/outbox"
)

// HeaderKey carries an outbox row's key, which AMQP has no place for.
const HeaderKey = "oncely-key"

// ErrBadRoutingKey is the error of a row whose topic cannot be a routing
// key (AMQP's short string: at most 255 bytes): it is parked.
var ErrBadRoutingKey = errors.New("rabbitconsumer: routing key longer than 255 bytes")

// Publisher publishes the outbox relay's rows to a RabbitMQ exchange
// (outbox.RelayConfig.Publisher): a row's topic is the routing key, its
// value the body, its headers the headers (the trace context among them),
// its key the HeaderKey header, and its stable message id the message_id
// property, so that a consumer's inbox (this package's Consumer among
// them) skips a row that a relay published again after stopping between
// the confirmation and marking it sent. Each message is persistent and
// mandatory: one that no queue takes is an error (the row stays pending and
// is retried), not a silent drop. Rows go one after another, each after the
// previous one's publisher confirmation, so the rows of a key are stored in
// enqueue-commit order.
//
// The Publisher dials its connection on first use and again after it is
// lost. Close it when the relay has stopped.
type Publisher struct {
	// URL is the AMQP URL to dial; or Dial opens the connection. One is
	// required.
	URL  string
	Dial func(ctx context.Context) (*amqp.Connection, error)
	// Exchange receives the rows; "" is the default exchange, which routes
	// a row to the queue named by its topic.
	Exchange string

	mu   sync.Mutex
	conn *amqp.Connection
	pub  *confirmer
}

// System is messaging.system: rabbitmq.
func (*Publisher) System() string { return System }

// channel returns the confirm channel, dialing a connection when there is
// none or the last one closed.
func (p *Publisher) channel(ctx context.Context) (*confirmer, error) {
	if p.pub != nil && !p.pub.ch.IsClosed() {
		return p.pub, nil
	}
	p.closeLocked()
	if p.URL == "" && p.Dial == nil {
		return nil, errors.New("rabbitconsumer: Publisher: URL or Dial is required")
	}
	var err error
	if p.conn, err = dial(ctx, p.URL, p.Dial, "oncely outbox relay"); err != nil {
		p.conn = nil
		return nil, err
	}
	if p.pub, err = newConfirmer(p.conn); err != nil {
		p.closeLocked()
		return nil, err
	}
	return p.pub, nil
}

// Publish publishes recs in order, each after the previous confirmation;
// after the first failure the rest are not published (they fail with the
// same error and stay pending).
func (p *Publisher) Publish(ctx context.Context, recs []*kgo.Record) []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	errs := make([]error, len(recs))
	fail := func(i int, err error) {
		for j := i; j < len(recs); j++ {
			errs[j] = err
		}
	}
	pub, err := p.channel(ctx)
	if err != nil {
		fail(0, err)
		return errs
	}
	for i, rec := range recs {
		msg := amqp.Publishing{Headers: amqp.Table{}, DeliveryMode: amqp.Persistent, Body: rec.Value, Timestamp: rec.Timestamp}
		for _, h := range rec.Headers {
			msg.Headers[h.Key] = string(h.Value)
			if h.Key == outbox.MessageIDHeader {
				msg.MessageId = string(h.Value)
			}
		}
		if rec.Key != nil {
			msg.Headers[HeaderKey] = string(rec.Key)
		}
		if err := pub.publish(ctx, p.Exchange, rec.Topic, msg); err != nil {
			fail(i, err)
			break
		}
	}
	return errs
}

// Refuse: a topic too long for a routing key.
func (*Publisher) Refuse(rec *kgo.Record) error {
	if len(rec.Topic) > 255 {
		return fmt.Errorf("%w: %d bytes", ErrBadRoutingKey, len(rec.Topic))
	}
	return nil
}

// Permanent: a routing key too long. Anything else (no queue bound, a
// refused confirmation, a lost connection) is retried.
func (*Publisher) Permanent(err error) bool { return errors.Is(err, ErrBadRoutingKey) }

// Close closes the connection, if any.
func (p *Publisher) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closeLocked()
	return nil
}

func (p *Publisher) closeLocked() {
	if p.conn != nil {
		_ = p.conn.Close()
	}
	p.conn, p.pub = nil, nil
}

var _ outbox.Publisher = (*Publisher)(nil)
