package main

import (
	"context"
	"errors"
	"flag"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/bench/internal/orderload"
	"github.com/oncely/oncely/outbox"
)

// The chaos binary is also its own broker and its own hand-written worker:
// the driver starts itself with one of these as the first argument.
const handArg = "-hand-worker" // the broker's is kfakechild.Arg

// handFirstCommitLine is what the hand-written worker logs when its first
// record committed (the orderworker logs "oncely first record committed").
const handFirstCommitLine = "hand first record committed"

// handWorker is the hand-written worker process: orderload.Hand (franz-go
// and pgx, a transaction per record: inbox insert, order, balance, outbox
// row) and oncely's outbox relay beside it, as a user of the outbox runs
// it, until SIGTERM. It logs one line when its first record committed.
func handWorker(args []string) error {
	fs := flag.NewFlagSet("hand-worker", flag.ContinueOnError)
	brokers := fs.String("brokers", "", "seed brokers, comma-separated")
	dbURL := fs.String("database-url", "", "Postgres URL")
	schema := fs.String("schema", "", "schema of oncely's and the orders tables")
	group := fs.String("group", "", "consumer group")
	topic := fs.String("topic", "", "orders topic")
	instance := fs.String("instance-id", "", "static membership id (empty: dynamic)")
	session := fs.Duration("session-timeout", 0, "group session timeout (0: franz-go's default)")
	rebalance := fs.Duration("rebalance-timeout", 0, "group rebalance timeout (0: franz-go's default)")
	heartbeat := fs.Duration("heartbeat-interval", 0, "group heartbeat interval (0: franz-go's default, 3s)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	started := time.Now()

	pool, err := pgxpool.New(ctx, *dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	store, err := orderload.NewStore(*schema)
	if err != nil {
		return err
	}
	var first sync.Once
	var opts []kgo.Opt
	if *heartbeat > 0 {
		opts = append(opts, kgo.HeartbeatInterval(*heartbeat))
	}
	h := orderload.NewHand(orderload.HandConfig{
		Brokers: strings.Split(*brokers, ","), Topic: *topic, Group: *group, InstanceID: *instance,
		SessionTimeout: *session, RebalanceTimeout: *rebalance, Pool: pool, Store: store,
		Opts:     opts,
		Assigned: func(m map[string][]int32) { log.Info("hand partitions assigned", "partitions", m) },
		Committed: func() {
			first.Do(func() { log.Info(handFirstCommitLine, "since_start", time.Since(started)) })
		},
	})
	relay, err := outbox.NewRelay(outbox.RelayConfig{
		Outbox: outbox.Config{Schema: *schema}, Pool: pool, Brokers: strings.Split(*brokers, ","),
		Logger: log,
	})
	if err != nil {
		return err
	}
	relayCtx, stopRelay := context.WithCancel(context.WithoutCancel(ctx))
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(relayCtx) }()
	err = h.Run(ctx)
	stopRelay()
	err = errors.Join(err, <-relayDone)
	log.Info("hand worker stopped", "retries", h.Retries())
	if errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}
