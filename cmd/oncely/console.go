package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/oncely/oncely/console"
	"github.com/oncely/oncely/internal/kafkaflags"
)

// tokenEnv gives the console's bearer token when --token is not set (so
// that it stays out of the process list).
const tokenEnv = "ONCELY_CONSOLE_TOKEN"

// consoleCmd serves the operator console:
//
//	oncely console [--listen 127.0.0.1:8089] [--database-url URL] [--schema oncely] [--brokers B]
//	               [--dlq-topic T]... [--nats URL [--stream S]...] [--token T] [--actions]
//	               [--inbox-retention D] [--sample-interval D]
//
// It binds to localhost unless --listen says otherwise, and refuses a
// non-loopback address without a token. With --nats it shows JetStream's
// dead-letter streams too (or only them, without --brokers).
func consoleCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("console", flag.ContinueOnError)
	var db dbFlags
	db.register(fs)
	var k kafkaFlags
	k.register(fs)
	listen := fs.String("listen", "127.0.0.1:8089", "address to serve on (host:port); a non-loopback host needs --token")
	token := fs.String("token", "", "bearer token every request must carry (env "+tokenEnv+"); open the console once with ?token=... in a browser")
	actions := fs.Bool("actions", false, "enable actions (redrive, retry, discard, pause, resume); default read-only")
	retention := fs.Duration("inbox-retention", 0, "the inbox cleaner's retention, shown beside the oldest inbox row (0: not shown)")
	sample := fs.Duration("sample-interval", 15*time.Second, "how often to sample consumer lag (the overview's trend) and read new dead letters")
	var topics, streams refs
	fs.Var(&topics, "dlq-topic", "dead-letter topic to show (repeatable; default every topic named *.dlq)")
	natsURL := fs.String("nats", os.Getenv("NATS_URL"), "NATS server whose JetStream dead-letter streams to show too (env NATS_URL; default none)")
	fs.Var(&streams, "stream", "JetStream dead-letter stream to show (repeatable, with --nats; default every stream whose subjects all start with dlq.)")
	if err := parse(fs, args, stderr); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usageErr("console: unexpected arguments %q", fs.Args())
	}
	if *token == "" && !kafkaflags.Given(fs, "token") {
		*token = os.Getenv(tokenEnv)
	}
	host, _, err := net.SplitHostPort(*listen)
	if err != nil {
		return usageErr("--listen: %v", err)
	}
	if ip := net.ParseIP(host); *token == "" && host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		return usageErr("--listen: %s is not a loopback address: set --token (or %s) to serve beyond this machine", host, tokenEnv)
	}
	cfg := console.Config{Schema: db.schema, Actions: *actions, DeadLetterTopics: topics,
		InboxRetention: *retention, SampleInterval: *sample, Logger: slog.New(slog.NewTextHandler(stderr, nil))}
	if *token != "" {
		if cfg.Auth, err = console.BearerToken(*token); err != nil {
			return usageErr("--token: %v", err)
		}
	}
	if strings.TrimSpace(k.brokers) != "" {
		if cfg.KafkaOpts, err = k.opts(); err != nil {
			return usageErr("%v", err)
		}
	}
	if len(streams) > 0 && *natsURL == "" {
		return usageErr("--stream: needs --nats, the NATS server of the stream")
	}
	if *natsURL != "" {
		// A server down at start-up, or later, is connected to when it
		// comes back; meanwhile the pages say it is unreachable, as they do
		// for Kafka.
		nc, err := nats.Connect(*natsURL, nats.Name("oncely console"), nats.Timeout(k.timeout),
			nats.RetryOnFailedConnect(true), nats.MaxReconnects(-1))
		if err != nil {
			return usageErr("--nats: %v", err)
		}
		defer nc.Close()
		if cfg.JetStream, err = jetstream.New(nc); err != nil {
			return err
		}
		cfg.DeadLetterStreams = streams
	}
	pool, err := db.connect(ctx, k.timeout)
	if err != nil {
		return err
	}
	defer pool.Close()
	cfg.Pool = pool
	h, err := console.New(cfg)
	if err != nil {
		return usageErr("%v", err)
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", *listen)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	mode := "read-only"
	if *actions {
		mode = "actions enabled"
	}
	fmt.Fprintf(stdout, "oncely console on http://%s/ (%s)\n", ln.Addr(), mode)
	// The sampler stops with the server: on ctx, or when Serve fails.
	rctx, stopRun := context.WithCancel(ctx)
	ran := make(chan struct{})
	go func() {
		defer close(ran)
		_ = h.Run(rctx) // returns nil when rctx is done; failed rounds are logged
	}()
	defer func() { stopRun(); <-ran }()
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		return err
	}
	if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
