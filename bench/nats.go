package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/oncely/oncely/bench/internal/runenv"
	"github.com/oncely/oncely/natsconsumer"
)

// natsCommand is the argument that selects the JetStream benchmark:
//
//	cd bench && go run . nats [flags]      (or: make bench-nats)
const natsCommand = "nats"

type natsOptions struct {
	brokerOptions
	natsURL   string
	handFetch int
	storage   string
}

// runNATS measures, in one run and on one workload, a hand-written
// JetStream consumer against natsconsumer per message and in batch mode:
// each round, for each mode, n messages are published to a fresh stream
// (file storage), then a fresh durable consumes them; each message's
// effect is one row inserted in its transaction. Rounds rotate the modes'
// order.
func runNATS(args []string) error {
	var o natsOptions
	fs := flag.NewFlagSet(natsCommand, flag.ExitOnError)
	fs.StringVar(&o.natsURL, "nats-url", cmp.Or(os.Getenv("NATS_URL"), nats.DefaultURL), "NATS server with JetStream (a fresh stream per mode and round, deleted afterwards)")
	fs.IntVar(&o.handFetch, "hand-fetch", 100, "messages per Fetch of the hand-written consumer")
	fs.StringVar(&o.storage, "storage", "file", "the streams' storage: file or memory")
	o.register(fs, "natsconsumer")
	_ = fs.Parse(args)
	modes, stopProfile, err := o.start(natsCommand)
	if err != nil {
		return err
	}
	defer stopProfile()
	if o.handFetch <= 0 {
		return errors.New("nats: -hand-fetch must be positive")
	}
	storage := jetstream.FileStorage
	switch o.storage {
	case "file":
	case "memory":
		storage = jetstream.MemoryStorage
	default:
		return fmt.Errorf("nats: -storage %q: want file or memory", o.storage)
	}
	ctx := context.Background()

	nc, err := nats.Connect(o.natsURL)
	if err != nil {
		return fmt.Errorf("nats at %s: %w", o.natsURL, err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	pool, schema, drop, err := brokerDB(ctx, o.dbURL, "bench_nats", o.concurrency)
	if err != nil {
		return err
	}
	defer drop()

	fmt.Printf("JetStream benchmark: %d messages a round (%d in the batch modes, %s storage), %d transactions in flight, batch size %d, hand-written Fetch %d, %d rounds, load average %s\n",
		o.n, o.batchN, o.storage, o.concurrency, o.batchSize, o.handFetch, o.rounds, runenv.LoadAverage())
	b := &brokerBench{n: o.n, batchN: o.batchN, rounds: o.rounds, modes: modes, pool: pool,
		label: func(m string) string { return o.label(m, fmt.Sprintf("Fetch %d", o.handFetch)) },
		run: func(ctx context.Context, m string, n int) (brokerRound, error) {
			stream := strings.ToUpper(uniqueName("BENCH"))
			if err := natsPublish(ctx, js, stream, storage, n); err != nil {
				return brokerRound{}, fmt.Errorf("publish: %w", err)
			}
			res, err := natsMode(ctx, m, js, stream, pool, schema, n, o)
			if derr := js.DeleteStream(context.WithoutCancel(ctx), stream); err == nil && derr != nil {
				err = fmt.Errorf("delete stream %s: %w", stream, derr)
			}
			return res, err
		}}
	return b.runRounds(ctx)
}

// natsPublish creates stream (subject <stream>.orders) and stores n
// messages in it, each with a unique message-id header, waiting for every
// PubAck.
func natsPublish(ctx context.Context, js jetstream.JetStream, stream string, storage jetstream.StorageType, n int) error {
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{stream + ".>"}, Storage: storage}); err != nil {
		return err
	}
	// The dead-letter stream natsconsumer checks for at start-up.
	if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{Name: stream + "_DLQ", Subjects: []string{"dlq." + stream + ".>"}, Storage: storage}); err != nil {
		return err
	}
	subject := stream + ".orders"
	for i := range n {
		m := nats.NewMsg(subject)
		m.Data = []byte(`{"order":` + strconv.Itoa(i) + `,"sku":"A-1","qty":1}`)
		m.Header.Set(benchIDHeader, stream+"-"+strconv.Itoa(i))
		if _, err := js.PublishMsgAsync(m); err != nil {
			return err
		}
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-time.After(time.Minute):
		return errors.New("PubAcks did not all arrive within a minute")
	case <-ctx.Done():
		return ctx.Err()
	}
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return err
	}
	if info.State.Msgs != uint64(n) {
		return fmt.Errorf("stream holds %d messages, want %d", info.State.Msgs, n)
	}
	return nil
}

// natsMode consumes the stream's n messages with mode m and times it.
func natsMode(ctx context.Context, m string, js jetstream.JetStream, stream string, pool *pgxpool.Pool, schema string, n int, o natsOptions) (brokerRound, error) {
	return timeMode(ctx, o.timeout, n, func() (func() int64, func(context.Context) error, error) {
		if m == modeHand {
			h := &natsHandConsumer{js: js, stream: stream, pool: pool, fetch: o.handFetch, workers: o.concurrency}
			return h.processed.Load, h.run, nil
		}
		cfg := natsconsumer.Config{JetStream: js, Stream: stream, Durable: benchGroup, Pool: pool, Schema: schema,
			Handler: benchEffect, Concurrency: o.concurrency}
		switch m {
		case modeBatch:
			cfg.Handler, cfg.BatchSize, cfg.BatchHandler = nil, o.batchSize, benchBatchEffect
		case modeBatchRecs:
			cfg.BatchSize = o.batchSize
		}
		c, err := natsconsumer.New(cfg)
		if err != nil {
			return nil, nil, err
		}
		return func() int64 { return c.Stats().Processed }, c.Run, nil
	})
}

// natsHandConsumer is the hand-written baseline: jetstream's pull Fetch and
// pgx, without oncely. workers goroutines each fetch up to fetch messages
// and, per message: the transaction of handEffect; Ack (not waiting for the server's
// confirmation: a lost ack is a redelivery, which the inbox absorbs).
type natsHandConsumer struct {
	js        jetstream.JetStream
	stream    string
	pool      *pgxpool.Pool
	fetch     int
	workers   int
	processed atomic.Int64
}

func (h *natsHandConsumer) run(ctx context.Context) error {
	cons, err := h.js.CreateOrUpdateConsumer(ctx, h.stream, jetstream.ConsumerConfig{
		Durable: benchGroup, AckPolicy: jetstream.AckExplicitPolicy, AckWait: 30 * time.Second,
		MaxAckPending: 2 * h.workers * h.fetch,
	})
	if err != nil {
		return err
	}
	return runWorkers(h.workers, func() error {
		for ctx.Err() == nil {
			batch, err := cons.Fetch(h.fetch, jetstream.FetchMaxWait(time.Second))
			if err != nil {
				return err
			}
			for msg := range batch.Messages() {
				if err := h.message(ctx, msg); err != nil {
					if ctx.Err() != nil {
						return nil // stopped
					}
					return err
				}
			}
		}
		return nil
	})
}

func (h *natsHandConsumer) message(ctx context.Context, msg jetstream.Msg) error {
	md, err := msg.Metadata()
	if err != nil {
		return err
	}
	id := msg.Headers().Get(benchIDHeader)
	if err := handEffect(ctx, h.pool, id, msg.Subject(), int64(md.Sequence.Stream)); err != nil {
		return err
	}
	h.processed.Add(1)
	return msg.Ack()
}
