package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/oncely/oncely/bench/internal/runenv"
	"github.com/oncely/oncely/rabbitconsumer"
)

// rabbitCommand is the argument that selects the RabbitMQ benchmark:
//
//	cd bench && go run . rabbit [flags]      (or: make bench-rabbit)
const rabbitCommand = "rabbit"

type rabbitOptions struct {
	brokerOptions
	amqpURL  string
	prefetch int
}

// runRabbit measures, in one run and on one workload, a hand-written
// amqp091-go consumer against rabbitconsumer per message and in batch
// mode: each round, for each mode, n persistent messages are published to
// a fresh quorum queue (the queue type rabbitconsumer recommends), then
// consumed; each message's effect is one row inserted in its transaction.
// Rounds rotate the modes' order.
func runRabbit(args []string) error {
	var o rabbitOptions
	fs := flag.NewFlagSet(rabbitCommand, flag.ExitOnError)
	fs.StringVar(&o.amqpURL, "amqp-url", cmp.Or(os.Getenv("AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/"), "RabbitMQ (a fresh quorum queue per mode and round, deleted afterwards)")
	fs.IntVar(&o.prefetch, "prefetch", 16, "basic.qos prefetch of the hand-written consumer and of rabbitconsumer per message (batch mode: Concurrency x BatchSize)")
	o.register(fs, "rabbitconsumer")
	_ = fs.Parse(args)
	modes, stopProfile, err := o.start(rabbitCommand)
	if err != nil {
		return err
	}
	defer stopProfile()
	if o.prefetch < o.concurrency {
		return errors.New("rabbit: -prefetch must be at least -concurrency")
	}
	ctx := context.Background()
	conn, err := amqp.Dial(o.amqpURL)
	if err != nil {
		return fmt.Errorf("rabbitmq at %s: %w", o.amqpURL, err)
	}
	defer func() { _ = conn.Close() }()
	pool, schema, drop, err := brokerDB(ctx, o.dbURL, "bench_rabbit", o.concurrency)
	if err != nil {
		return err
	}
	defer drop()

	fmt.Printf("RabbitMQ benchmark: %d messages a round (%d in the batch modes), quorum queues, persistent messages, %d transactions in flight, prefetch %d (batch mode %d), batch size %d, %d rounds, load average %s\n",
		o.n, o.batchN, o.concurrency, o.prefetch, o.concurrency*o.batchSize, o.batchSize, o.rounds, runenv.LoadAverage())
	b := &brokerBench{n: o.n, batchN: o.batchN, rounds: o.rounds, modes: modes, pool: pool,
		label: func(m string) string { return o.label(m, fmt.Sprintf("prefetch %d", o.prefetch)) },
		run: func(ctx context.Context, m string, n int) (brokerRound, error) {
			queue := uniqueName("oncely-bench")
			queues := []string{queue, rabbitconsumer.DefaultDeadLetterRoutingKey(queue), rabbitconsumer.DefaultRetryQueue(queue)}
			defer func() {
				ch, err := conn.Channel()
				if err != nil {
					return
				}
				defer func() { _ = ch.Close() }()
				for _, q := range queues {
					_, _ = ch.QueueDelete(q, false, false, false)
				}
			}()
			if err := rabbitPublish(ctx, conn, queues[:2], n); err != nil {
				return brokerRound{}, fmt.Errorf("publish: %w", err)
			}
			return rabbitMode(ctx, m, queue, pool, schema, n, o)
		}}
	return b.runRounds(ctx)
}

// rabbitPublish declares queues (the first the one consumed, the second
// its dead-letter queue, which rabbitconsumer checks for at start-up) as
// quorum queues and publishes n persistent messages to the first, each
// with a unique message_id, waiting for every publisher confirmation.
func rabbitPublish(ctx context.Context, conn *amqp.Connection, queues []string, n int) error {
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer func() { _ = ch.Close() }()
	for _, q := range queues {
		if _, err := ch.QueueDeclare(q, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
			return err
		}
	}
	if err := ch.Confirm(false); err != nil {
		return err
	}
	confirms := make([]*amqp.DeferredConfirmation, 0, n)
	for i := range n {
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queues[0], false, false, amqp.Publishing{
			MessageId: queues[0] + "-" + strconv.Itoa(i), DeliveryMode: amqp.Persistent, ContentType: "application/json",
			Body: []byte(`{"order":` + strconv.Itoa(i) + `,"sku":"A-1","qty":1}`),
		})
		if err != nil {
			return err
		}
		confirms = append(confirms, dc)
	}
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for _, dc := range confirms {
		ok, err := dc.WaitContext(wctx)
		if err != nil {
			return fmt.Errorf("publish not confirmed: %w", err)
		}
		if !ok {
			return errors.New("publish refused (basic.nack)")
		}
	}
	q, err := ch.QueueDeclarePassive(queues[0], true, false, false, false, nil)
	if err != nil {
		return err
	}
	if q.Messages != n {
		return fmt.Errorf("queue holds %d messages, want %d", q.Messages, n)
	}
	return nil
}

// rabbitMode consumes the queue's n messages with mode m and times it.
func rabbitMode(ctx context.Context, m, queue string, pool *pgxpool.Pool, schema string, n int, o rabbitOptions) (brokerRound, error) {
	return timeMode(ctx, o.timeout, n, func() (func() int64, func(context.Context) error, error) {
		if m == modeHand {
			h := &rabbitHandConsumer{url: o.amqpURL, queue: queue, pool: pool, prefetch: o.prefetch, workers: o.concurrency}
			return h.processed.Load, h.run, nil
		}
		cfg := rabbitconsumer.Config{URL: o.amqpURL, Queues: []string{queue}, Group: benchGroup, Pool: pool, Schema: schema,
			Handler: benchEffect, Concurrency: o.concurrency, Prefetch: o.prefetch}
		switch m {
		case modeBatch: // Prefetch: the default, Concurrency x BatchSize
			cfg.Handler, cfg.BatchSize, cfg.BatchHandler, cfg.Prefetch = nil, o.batchSize, benchBatchEffect, 0
		case modeBatchRecs:
			cfg.BatchSize, cfg.Prefetch = o.batchSize, 0
		}
		c, err := rabbitconsumer.New(cfg)
		if err != nil {
			return nil, nil, err
		}
		return func() int64 { return c.Stats().Processed }, c.Run, nil
	})
}

// rabbitHandConsumer is the hand-written baseline: amqp091-go and pgx,
// without oncely. One connection and channel with manual acks and a
// prefetch; workers goroutines take its deliveries and, per message: the
// transaction of handEffect, then basic.ack.
type rabbitHandConsumer struct {
	url       string
	queue     string
	pool      *pgxpool.Pool
	prefetch  int
	workers   int
	processed atomic.Int64
}

func (h *rabbitHandConsumer) run(ctx context.Context) error {
	conn, err := amqp.Dial(h.url)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	if err := ch.Qos(h.prefetch, 0, false); err != nil {
		return err
	}
	deliveries, err := ch.Consume(h.queue, "", false, false, false, false, nil)
	if err != nil {
		return err
	}
	return runWorkers(h.workers, func() error {
		for {
			select {
			case <-ctx.Done():
				return nil
			case d, ok := <-deliveries:
				if !ok {
					return errors.New("the channel closed")
				}
				if err := handEffect(ctx, h.pool, d.MessageId, h.queue, int64(d.DeliveryTag)); err != nil {
					if ctx.Err() != nil {
						return nil // stopped
					}
					return err
				}
				h.processed.Add(1)
				if err := d.Ack(false); err != nil {
					return err
				}
			}
		}
	})
}
