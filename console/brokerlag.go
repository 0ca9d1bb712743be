package console

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/oncely/oncely/webhook/outbound"
)

// ---- RabbitMQ queues' and JetStream consumers' backlog ----

// The overview's backlog of the other brokers, as lagRows (sampled and
// trended as Kafka's lag is, in a history of their own): a RabbitMQ
// queue's is its messages ready (Topic the queue, Partition 0, Consumers
// its consumers), a JetStream durable consumer's its messages pending
// (Group the consumer, Topic the stream, AckPending, Redelivered and
// Waiting its counts, Active its last delivery).

// rabbitLag reads the messages ready and the consumers of the queues
// (Config.Queues) by passive declarations on one connection.
func (s *server) rabbitLag(ctx context.Context) ([]lagRow, error) {
	conn, err := s.rabbit.dial(ctx)
	if err != nil {
		return nil, fmt.Errorf("RabbitMQ at %s: %w", outbound.RedactURL(s.rabbit.url), err)
	}
	defer func() { _ = conn.Close() }()
	var out []lagRow
	for _, q := range s.rabbitQueues {
		row := lagRow{Topic: q}
		// A channel each: a failed declaration closes its channel.
		ch, err := conn.Channel()
		if err != nil {
			return nil, fmt.Errorf("RabbitMQ: open channel: %w", err)
		}
		st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
		switch ae := (*amqp.Error)(nil); {
		case errors.As(err, &ae) && ae.Code == amqp.NotFound:
			row.Err = "no such queue"
		case err != nil:
			row.Err = err.Error()
		default:
			row.Lag, row.Consumers = int64(st.Messages), st.Consumers
			_ = ch.Close()
		}
		out = append(out, row)
	}
	now := time.Now()
	s.rabbitHistory.record(now, out)
	s.rabbitHistory.trend(now, out)
	return out, nil
}

// jetStreamLag reads the durable consumers of the streams (Config.Streams;
// default every stream but the dead-letter streams).
func (s *server) jetStreamLag(ctx context.Context) ([]lagRow, error) {
	j := s.jetstream
	if err := j.connected(); err != nil {
		return nil, err
	}
	streams := s.cfg.Streams
	if len(streams) == 0 {
		dead, err := j.places(ctx)
		if err != nil {
			return nil, err
		}
		names := j.js.StreamNames(ctx)
		for name := range names.Name() {
			if !slices.Contains(dead, name) {
				streams = append(streams, name)
			}
		}
		if err := names.Err(); err != nil {
			return nil, fmt.Errorf("list JetStream streams: %w", err)
		}
	}
	var out []lagRow
	for _, name := range streams {
		st, err := j.js.Stream(ctx, name)
		if err != nil {
			out = append(out, lagRow{Topic: name, Err: err.Error()})
			continue
		}
		l := st.ListConsumers(ctx)
		for ci := range l.Info() {
			if ci.Config.Durable == "" {
				continue
			}
			row := lagRow{Group: ci.Name, Topic: name, Lag: int64(ci.NumPending), AckPending: int64(ci.NumAckPending),
				Redelivered: int64(ci.NumRedelivered), Waiting: int64(ci.NumWaiting)}
			if ci.Delivered.Last != nil {
				row.Active = *ci.Delivered.Last
			}
			out = append(out, row)
		}
		if err := l.Err(); err != nil {
			out = append(out, lagRow{Topic: name, Err: "list consumers: " + err.Error()})
		}
	}
	slices.SortFunc(out, func(a, b lagRow) int {
		return strings.Compare(a.Topic+"\x00"+a.Group, b.Topic+"\x00"+b.Group)
	})
	now := time.Now()
	s.jetStreamHistory.record(now, out)
	s.jetStreamHistory.trend(now, out)
	return out, nil
}

// idleAfter is how long a JetStream consumer with messages pending, none
// awaiting acknowledgement and no pull request waiting may go without a
// delivery before the overview finds that no one consumes.
const idleAfter = time.Minute

// brokersNotReady is what of the RabbitMQ queues and JetStream consumers
// is not ready: a queue with messages ready and no consumer, a consumer
// with messages pending that no one has pulled for idleAfter, and what
// could not be read.
func brokersNotReady(d *overviewData, now time.Time) []notReady {
	var out []notReady
	if d.RabbitErr != "" {
		out = append(out, notReady{"RabbitMQ", d.RabbitErr})
	}
	for _, r := range d.Rabbit {
		switch {
		case r.Err != "":
			out = append(out, notReady{fmt.Sprintf("RabbitMQ queue %q", r.Topic), r.Err})
		case r.Lag > 0 && r.Consumers == 0:
			out = append(out, notReady{fmt.Sprintf("RabbitMQ queue %q", r.Topic), fmt.Sprintf("%d messages ready and no consumer", r.Lag)})
		}
	}
	if d.JetStreamErr != "" {
		out = append(out, notReady{"JetStream", d.JetStreamErr})
	}
	for _, r := range d.JetStream {
		switch {
		case r.Err != "":
			out = append(out, notReady{fmt.Sprintf("JetStream stream %q", r.Topic), r.Err})
		case r.Lag > 0 && r.AckPending == 0 && r.Waiting == 0 && now.Sub(r.Active) > idleAfter:
			since := "ever"
			if !r.Active.IsZero() {
				since = "for " + now.Sub(r.Active).Round(time.Second).String()
			}
			out = append(out, notReady{fmt.Sprintf("JetStream consumer %q of stream %q", r.Group, r.Topic),
				fmt.Sprintf("%d messages pending and nothing delivered %s, no pull request waiting: is a consumer running?", r.Lag, since)})
		}
	}
	return out
}
