package rabbitconsumer

import (
	"context"
	"errors"
	"fmt"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"
)

// ErrUnroutable is wrapped by a publish that RabbitMQ returned because no
// queue is bound to take it (the mandatory flag): without the flag the
// message would have been dropped in silence.
var ErrUnroutable = errors.New("rabbitconsumer: message returned unroutable")

// ErrNotConfirmed is wrapped by a publish that RabbitMQ refused to confirm
// (a basic.nack: the queue could not store it), or whose channel closed
// before the confirmation came.
var ErrNotConfirmed = errors.New("rabbitconsumer: publish not confirmed")

// confirmer publishes on a channel in confirm mode, one message at a time:
// each publish is mandatory and returns only after RabbitMQ's basic.ack (or
// fails on its basic.return or basic.nack). One at a time, a return is
// known to belong to the publish in flight: RabbitMQ sends basic.return
// before the basic.ack of the same message, and the client hands both over
// in that order.
type confirmer struct {
	mu      sync.Mutex
	ch      *amqp.Channel
	returns chan amqp.Return
}

// newConfirmer opens a channel on conn and puts it in confirm mode.
func newConfirmer(conn *amqp.Connection) (*confirmer, error) {
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("rabbitconsumer: open publishing channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		_ = ch.Close()
		return nil, fmt.Errorf("rabbitconsumer: confirm mode: %w", err)
	}
	return &confirmer{ch: ch, returns: ch.NotifyReturn(make(chan amqp.Return, 1))}, nil
}

// publish publishes msg to exchange with routing key and waits for its
// confirmation: nil once RabbitMQ stored it in every queue it routes to.
func (p *confirmer) publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.returns: // the return of a publish whose wait was given up
	default:
	}
	dc, err := p.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, msg)
	if err != nil {
		return fmt.Errorf("rabbitconsumer: publish to exchange %q, routing key %q: %w", exchange, key, err)
	}
	acked, err := dc.WaitContext(ctx)
	if err != nil {
		return fmt.Errorf("rabbitconsumer: publish to exchange %q, routing key %q: waiting for the confirmation: %w", exchange, key, err)
	}
	select {
	case ret := <-p.returns:
		return fmt.Errorf("%w: exchange %q, routing key %q: %d %s", ErrUnroutable, exchange, key, ret.ReplyCode, ret.ReplyText)
	default:
	}
	if !acked {
		return fmt.Errorf("%w: exchange %q, routing key %q", ErrNotConfirmed, exchange, key)
	}
	return nil
}
