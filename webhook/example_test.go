package webhook_test

import (
	"context"
	"log"
	"net/http"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/outbox"
	"github.com/oncely/oncely/webhook"
)

// A Standard Webhooks endpoint whose deliveries go to the "orders" topic.
// (While a secret is being rotated, list the new and the old one.) A relay
// (outbox.Relay) publishes what the receiver stores, and a consumer
// (package consumer) processes each delivery once.
func ExampleNew() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	v, err := webhook.NewStandardWebhooks(webhook.VerifierConfig{
		Secrets: []string{os.Getenv("WEBHOOK_SECRET")}, // whsec_...
	})
	if err != nil {
		log.Fatal(err)
	}
	rc, err := webhook.New(webhook.Config{
		Pool:     pool,
		Outbox:   outbox.Config{Schema: "oncely"},
		Topic:    "orders",
		Verifier: v,
	})
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/webhooks/orders", rc) // the receiver answers other methods 405 itself
	srv := &http.Server{Addr: ":8080", Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	log.Fatal(srv.ListenAndServe())
}
