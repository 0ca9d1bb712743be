package oncely_test

import (
	"context"
	"log"
	"net/http"
	"os"
	"os/signal"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely"
	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/idempotency"
	"github.com/oncely/oncely/outbox"
)

// account is the client a request's credentials prove; a real service
// verifies them (here, a fixed table of API keys).
func account(req *http.Request) string {
	return map[string]string{"Bearer key-of-acme": "acme"}[req.Header.Get("Authorization")]
}

// A service with a consumer, an outbox relay and an HTTP API behind
// Idempotency-Key, configured once and run until SIGINT.
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	r, err := oncely.New(oncely.Config{
		Pool:       pool,
		Schema:     "payments", // once, for every component
		HTTPAddr:   ":8080",
		Brokers:    []string{"localhost:9092"},
		Migrate:    true,
		Relay:      &outbox.RelayConfig{},
		ExtraConns: 2, // the HTTP handlers'
	})
	if err != nil {
		log.Fatal(err) // names the field
	}
	_, err = r.AddConsumer(consumer.Config{
		Group:  "payments",
		Topics: []string{"payments"},
		Handler: func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			_, err := r.Outbox().Enqueue(ctx, tx, outbox.Message{Topic: "payment-events", Key: msg.Key, Value: msg.Value})
			return err
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	// Keys are per client: Scope names the authenticated client of each
	// request (a keyed request naming none gets 401). The cleanup of
	// expired keys runs with the runner.
	keys, err := r.Idempotency(idempotency.Config{Scope: account})
	if err != nil {
		log.Fatal(err)
	}

	// Served on Config.HTTPAddr beside GET /livez, /readyz and /metrics.
	r.Handle("POST /payments", keys.Require(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		w.WriteHeader(http.StatusAccepted) // write through idempotency.Tx(req.Context())
	})))
	if err := r.Run(ctx); err != nil { // until SIGINT, then HTTP, consumers and relay stop in order
		log.Fatal(err)
	}
}
