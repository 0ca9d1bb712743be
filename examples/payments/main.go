// Command payments is a payments service on the oncely runner (see docs/QUICKSTART.md).
package main

import (
	"cmp"
	"context"
	_ "embed"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/oncely/oncely"
	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/idempotency"
	"github.com/oncely/oncely/outbox"
	"github.com/oncely/oncely/webhook"
)

//go:embed schema.sql
var schemaSQL string

const stripeTopic, refundTopic, eventTopic = "stripe-events", "refunds", "payment-events"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Getenv, nil)
	stop()
	if err != nil {
		slog.Error("payments", "err", err)
		os.Exit(1)
	}
}

// run serves until ctx is done; it listens on ln, or on HTTP_ADDR if ln is nil.
func run(ctx context.Context, getenv func(string) string, ln net.Listener) error {
	var clients map[string]string // API key -> client
	if err := json.Unmarshal([]byte(cmp.Or(getenv("API_KEYS"), `{"dev-key": "dev"}`)), &clients); err != nil {
		return fmt.Errorf("API_KEYS: %w", err)
	}
	stripe, err := webhook.NewStripe(webhook.VerifierConfig{Secrets: []string{getenv("STRIPE_WEBHOOK_SECRET")}})
	if err != nil {
		return fmt.Errorf("STRIPE_WEBHOOK_SECRET: %w", err)
	}
	schema := cmp.Or(getenv("SCHEMA"), "payments")
	pool, err := oncely.NewPool(ctx, cmp.Or(getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/postgres"), schema)
	if err != nil {
		return err
	}
	defer pool.Close()
	r, err := oncely.New(oncely.Config{
		Pool: pool, Schema: schema, Logger: slog.Default(), Migrate: true,
		Brokers:     strings.Split(cmp.Or(getenv("KAFKA_BROKERS"), "127.0.0.1:9092"), ","),
		BeforeStart: func(ctx context.Context) error { _, err := pool.Exec(ctx, schemaSQL); return err },
		Relay:       &outbox.RelayConfig{}, ExtraConns: 4, // ExtraConns: the HTTP handlers' connections
		InboxCleaner: &dedup.CleanerConfig{Retention: 7 * 24 * time.Hour}, // beyond Stripe's 3 days of retries
		HTTPAddr:     cmp.Or(getenv("HTTP_ADDR"), ":8080"), Listener: ln,  // GET /livez, /readyz, /metrics, and r.Handle's routes
	})
	if err != nil {
		return err
	}
	if _, err := r.AddConsumer(consumer.Config{Group: "payments", Topics: []string{stripeTopic, refundTopic}, Handler: handler(r.Outbox())}); err != nil {
		return err
	}
	keys, err := r.Idempotency(idempotency.Config{Scope: func(req *http.Request) string { // keys per client; none: 401
		return clients[strings.TrimPrefix(req.Header.Get("Authorization"), "Bearer ")]
	}})
	if err != nil {
		return err
	}
	hook, err := r.Webhook(webhook.Config{Topic: stripeTopic, Verifier: stripe})
	if err != nil {
		return err
	}
	r.Handle("POST /payments", keys.Require(createPayment(r.Outbox())))
	r.Handle("POST /webhooks/stripe", hook)
	return r.Run(ctx)
}

// createPayment handles {"amount": 1999, "currency": "eur"}; a retry gets the recorded response.
func createPayment(out *outbox.Outbox) http.HandlerFunc {
	return func(w http.ResponseWriter, req *http.Request) {
		var p struct {
			Amount   int64
			Currency string
		}
		if err := json.NewDecoder(req.Body).Decode(&p); err != nil || p.Amount <= 0 || len(p.Currency) != 3 {
			http.Error(w, `want {"amount": <minor units, above 0>, "currency": "<ISO 4217 code>"}`, http.StatusBadRequest)
			return
		}
		tx, _ := idempotency.Tx(req.Context())         // Require: every request has one
		client, _, _ := idempotency.Key(req.Context()) // the scope: the API client
		var id string
		if err := tx.QueryRow(req.Context(), `INSERT INTO payments (client, amount, currency) VALUES ($1, $2, $3) RETURNING id`,
			client, p.Amount, p.Currency).Scan(&id); err != nil || publish(req.Context(), tx, out, "payment.created", id, p.Amount) != nil {
			http.Error(w, "cannot create the payment now", http.StatusServiceUnavailable) // not recorded: a retry runs afresh
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(map[string]string{"id": id, "status": "created"})
	}
}

// handler runs once per message id: the inbox claim, ledger row and event commit in tx.
func handler(out *outbox.Outbox) consumer.Handler {
	return func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		var m struct { // a Stripe event (data.object: a PaymentIntent) or a refund request
			Type      string
			Data      map[string]struct{ Metadata map[string]string }
			PaymentID string `json:"payment_id"`
			Amount    int64
		}
		if err := json.Unmarshal(msg.Value, &m); err != nil {
			return dlq.Undecodable(err) // dead-lettered at once, class undecodable
		}
		effect, event := "refund", "payment.refunded"
		if msg.Topic == stripeTopic {
			if m.Type != "payment_intent.succeeded" {
				return nil // an event this service does not act on
			}
			effect, event, m.PaymentID = "capture", "payment.captured", m.Data["object"].Metadata["payment_id"]
		}
		var amount *int64 // schema.sql's capture and refund: NULL when not allowed
		if err := tx.QueryRow(ctx, "SELECT "+effect+"($1, $2, $3)", m.PaymentID, m.Amount, msg.ID).Scan(&amount); err != nil {
			return err
		} else if amount == nil { // retrying would not change that: dead-letter it, class permanent
			return dlq.Permanent(fmt.Errorf("%s of %d: payment %q is unknown or does not allow it", effect, m.Amount, m.PaymentID))
		}
		return publish(ctx, tx, out, event, m.PaymentID, *amount)
	}
}

// publish enqueues a payment event in tx; the relay publishes it after the commit.
func publish(ctx context.Context, tx pgx.Tx, out *outbox.Outbox, event, id string, amount int64) error {
	v, _ := json.Marshal(map[string]any{"type": event, "payment_id": id, "amount": amount})
	_, err := out.Enqueue(ctx, tx, outbox.Message{Topic: eventTopic, Key: []byte(id), Value: v})
	return err
}
