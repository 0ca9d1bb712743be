package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/natsconsumer"
	"github.com/oncely/oncely/rabbitconsumer"
	"github.com/oncely/oncely/webhook/outbound"
)

// brokerCheck is what the history check reads from the broker of one
// --source: whether the group caught up, the history of the orders topic,
// the events and the dead letters.
type brokerCheck struct {
	// caughtUp reports whether the group has nothing left to deliver.
	caughtUp func(ctx context.Context) (bool, error)
	// history is what the producers sent (see readHistory).
	history func(ctx context.Context) (orderBatch, error)
	// events checks the events topic (verifyEvents); deadLetters the
	// dead letters (verifyDeadLetters).
	events, deadLetters func(ctx context.Context, b orderBatch, r *report) error
	close               func()
}

// kafkaCheck reads the history, the events and the dead letters from the
// Kafka topics; the group caught up when its committed offsets reached the
// end of topic.
func kafkaCheck(brokers []string, topic, events, group string) (*brokerCheck, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		return nil, err
	}
	adm := kadm.NewClient(cl)
	return &brokerCheck{
		caughtUp: func(ctx context.Context) (bool, error) { return offsetsCaughtUp(ctx, adm, group, topic) },
		history:  func(ctx context.Context) (orderBatch, error) { return readHistory(ctx, brokers, topic) },
		events: func(ctx context.Context, b orderBatch, r *report) error {
			return checkEvents(ctx, brokers, events, b, r)
		},
		deadLetters: func(ctx context.Context, b orderBatch, r *report) error {
			return checkDeadLetters(ctx, brokers, dlq.DefaultTopic(topic), group, b, r)
		},
		close: cl.Close,
	}, nil
}

// jetStreamCheck reads the history from the stream of the orders subject
// topic (the worker's streams keep every message), the events and the dead
// letters from theirs; the group (the durable consumer) caught up when it
// has no message pending or waiting for its ack.
func jetStreamCheck(url, topic, events, group string) (*brokerCheck, error) {
	nc, js, err := jetStreamConn(url, "orderworker check")
	if err != nil {
		return nil, err
	}
	limit := func() (int, error) { return int(nc.MaxPayload()), nil }
	dlqSubject := natsconsumer.DefaultDeadLetterSubject(topic)
	return &brokerCheck{
		caughtUp: func(ctx context.Context) (bool, error) { return jetStreamSettled(ctx, js, topic, group) },
		history: func(ctx context.Context) (orderBatch, error) {
			recs, err := natsconsumer.ReadStream(ctx, js, streamName(topic))
			if err != nil {
				return orderBatch{}, fmt.Errorf("read orders: %w", err)
			}
			return historyOf(recs, int(nc.MaxPayload())), nil
		},
		events: func(ctx context.Context, b orderBatch, r *report) error {
			recs, err := natsconsumer.ReadStream(ctx, js, streamName(events))
			if err != nil {
				return fmt.Errorf("read events: %w", err)
			}
			return verifyEvents(recs, events, b, r, limit)
		},
		deadLetters: func(ctx context.Context, b orderBatch, r *report) error {
			entries, err := natsconsumer.DeadLetters(ctx, js, streamName(dlqSubject), dlq.Filter{})
			if err != nil {
				return fmt.Errorf("read dead letters: %w", err)
			}
			verifyDeadLetters(entries, dlqSubject, group, b, r, int(nc.MaxPayload()))
			return nil
		},
		close: nc.Close,
	}, nil
}

// jetStreamSettled reports whether the durable consumer group of topic's
// stream has no message pending or waiting for its ack.
func jetStreamSettled(ctx context.Context, js jetstream.JetStream, topic, group string) (bool, error) {
	c, err := js.Consumer(ctx, streamName(topic), group)
	if err != nil {
		return false, err
	}
	info, err := c.Info(ctx)
	return err == nil && info.NumPending == 0 && info.NumAckPending == 0, err
}

// rabbitMaxMessage is RabbitMQ's default max_message_size.
const rabbitMaxMessage = 128 << 20

// rabbitCheck checks a RabbitMQ queue's worker against the history file
// that `produce --history` wrote (a queue keeps nothing once it is
// acknowledged). The group caught up when the queue and its retry queue
// hold no ready message and the inbox holds a row for every message id of
// the history. The events queue and the dead-letter queue are read without
// taking their messages (closing the channel gives them back).
func rabbitCheck(url, historyFile, topic, events, group string, pool *pgxpool.Pool, schema string) (*brokerCheck, error) {
	b, err := readHistoryFile(historyFile, topic)
	if err != nil {
		return nil, err
	}
	conn, err := amqp.Dial(url)
	if err != nil {
		return nil, fmt.Errorf("RabbitMQ at %s: %w", outbound.RedactURL(url), err)
	}
	dlqQueue := rabbitconsumer.DefaultDeadLetterRoutingKey(topic)
	q := newEffectQueries(schema)
	return &brokerCheck{
		caughtUp: func(ctx context.Context) (bool, error) {
			for _, queue := range []string{topic, rabbitconsumer.DefaultRetryQueue(topic)} {
				if n, err := queueDepth(conn, queue); err != nil || n > 0 {
					return false, err
				}
			}
			n, err := queryInt(ctx, pool, q.inbox, group)
			return n >= int64(len(b.Orders)+len(b.Poison)), err
		},
		history: func(context.Context) (orderBatch, error) { return b, nil },
		events: func(_ context.Context, b orderBatch, r *report) error {
			recs, err := readQueue(conn, events)
			if err != nil {
				return fmt.Errorf("read events: %w", err)
			}
			return verifyEvents(recs, events, b, r, func() (int, error) { return rabbitMaxMessage, nil })
		},
		deadLetters: func(ctx context.Context, b orderBatch, r *report) error {
			dq, err := rabbitconsumer.OpenDeadLetters(ctx, url, dlqQueue)
			if err != nil {
				return err
			}
			defer dq.Close()
			entries, err := dq.Entries(ctx, dlq.Filter{})
			if err != nil {
				return fmt.Errorf("read dead letters: %w", err)
			}
			verifyDeadLetters(entries, dlqQueue, group, b, r, rabbitMaxMessage)
			return nil
		},
		close: func() { _ = conn.Close() },
	}, nil
}

// queueDepth is the number of ready messages in queue, from a passive
// declaration on a channel of its own (a failed one closes its channel).
func queueDepth(conn *amqp.Connection, queue string) (int, error) {
	ch, err := conn.Channel()
	if err != nil {
		return 0, err
	}
	defer ch.Close()
	info, err := ch.QueueDeclarePassive(queue, true, false, false, false, amqp.Table{"x-queue-type": "quorum"})
	return info.Messages, err
}

// readQueue reads every message of queue as a record: the body, the
// headers, the key from rabbitconsumer.HeaderKey and the message id from
// the message_id property when no header carries it. It takes none: the
// messages stay unacknowledged until its channel closes, which gives them
// back to the queue.
func readQueue(conn *amqp.Connection, queue string) ([]*kgo.Record, error) {
	ch, err := conn.Channel()
	if err != nil {
		return nil, err
	}
	defer ch.Close()
	var recs []*kgo.Record
	for {
		d, ok, err := ch.Get(queue, false)
		if err != nil || !ok {
			return recs, err
		}
		rec := &kgo.Record{Topic: queue, Offset: int64(len(recs)), Value: d.Body}
		for k, v := range d.Headers {
			s, _ := v.(string)
			rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: k, Value: []byte(s)})
			if k == rabbitconsumer.HeaderKey {
				rec.Key = []byte(s)
			}
		}
		if header(rec, consumer.DefaultMessageIDHeader) == "" && d.MessageId != "" {
			rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: consumer.DefaultMessageIDHeader, Value: []byte(d.MessageId)})
		}
		recs = append(recs, rec)
	}
}

// historyLine is a record of a history file, one JSON object a line.
type historyLine struct {
	Key       string `json:"key"`
	Value     []byte `json:"value"`
	MessageID string `json:"message_id"`
}

// writeHistory writes ds, as the records of topic they are published as, to
// the file path.
func writeHistory(path, topic string, ds []delivery) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("history: %w", err)
	}
	w := bufio.NewWriter(f)
	enc := json.NewEncoder(w)
	for _, d := range ds {
		rec := d.record(topic)
		if err := enc.Encode(historyLine{Key: string(rec.Key), Value: rec.Value, MessageID: d.MessageID}); err != nil {
			_ = f.Close()
			return fmt.Errorf("history: %w", err)
		}
	}
	if err := errors.Join(w.Flush(), f.Close()); err != nil {
		return fmt.Errorf("history: %w", err)
	}
	return nil
}

// readHistoryFile reads a history file that writeHistory wrote: the n-th
// record as topic/0/n, sorted out as readHistory does.
func readHistoryFile(path, topic string) (orderBatch, error) {
	f, err := os.Open(path)
	if err != nil {
		return orderBatch{}, fmt.Errorf("history: %w", err)
	}
	defer f.Close()
	var recs []*kgo.Record
	dec := json.NewDecoder(bufio.NewReader(f))
	for dec.More() {
		var l historyLine
		if err := dec.Decode(&l); err != nil {
			return orderBatch{}, fmt.Errorf("history %s: record %d: %w", path, len(recs), err)
		}
		recs = append(recs, &kgo.Record{Topic: topic, Offset: int64(len(recs)), Key: []byte(l.Key), Value: l.Value,
			Headers: []kgo.RecordHeader{{Key: consumer.DefaultMessageIDHeader, Value: []byte(l.MessageID)}}})
	}
	if len(recs) == 0 {
		return orderBatch{}, fmt.Errorf("history %s: no record", path)
	}
	return historyOf(recs, rabbitMaxMessage), nil
}
